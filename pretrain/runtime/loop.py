"""The training loop of every stage that trains: pretraining, fine-tuning and detection.

    run = prepare_run(...)                 data, the schedule's length (optim.epochs, or a compute budget's
                                           counted steps), task, optimizer and schedules, DeepSpeed engine, resume,
                                           monitor
    for every epoch, `train_one_epoch(run)`: for every optimizer step of the epoch
        set_schedule_values                the step's learning rate and weight decay
        optimizer_step                     [a step that reads (step_reads): the losses noted so far finite?]
                                           grad_accum times: micro-batch -> train_step (task.batch_loss ->
                                           [a step that reads: finite on every rank? else: noted on the device]
                                           -> backward -> [last micro-batch: gradient edits] -> engine.step)
        task.after_step -> agree_on_stop -> [epoch end: task.after_epoch]
        [checkpoint or signal: the losses noted so far finite?]
        log_step, log_image_grids -> [checkpoint_due: save_checkpoint (+ task.write_export)] -> [stop signal:
                                           stop_on_signal]
A step that neither logs nor checkpoints reads nothing back from the device on one process (tests/test_device_reads.py
counts it); on several, the stop check's one all-reduce a step (`agree_on_stop`).

A stage (pretrain/pretraining.py, transfer/finetune/stage.py, transfer/detection/stage.py) describes its run as a
`Stage` (pretrain/runtime/stage.py): its data, its task (a `pretrain.runtime.task.TrainingTask`, the module the
engine wraps, which turns a batch into a loss), its optimizer and schedules, what it records. `run_training(stage)`
does the rest the same way for all: processes and the run lock, seeds, the DeepSpeed engine and its config, resume
through the run-layout check, divergence, checkpoints, logging, the graceful stop.

Runs as one process (`python -m ...`) or several (`torchrun` / `deepspeed` / Slurm through `launch`);
DeepSpeed ZeRO shards optimizer state (stage 1), gradients (2) and parameters (3) across them.

Precision: weights, gradients (accumulated and all-reduced) and optimizer state are fp32 in every ZeRO stage;
`engine.precision=bf16` runs the task's forwards under `torch.autocast(bfloat16)`. DeepSpeed's own bf16 mode is
not used: it casts the weights to bf16 (BatchNorm then fails with bf16 weights and fp32 running statistics),
and for ZeRO stage 0 it accumulates and all-reduces gradients in bf16 (DeepSpeed 0.19 refuses fp32
accumulation there: "unsupported mix of model_dtype=torch.bfloat16 and grad_accum_dtype=torch.float32").

Gradient clipping: DeepSpeed 0.19.8 clips the global gradient norm at 1.0 when its config has no
`gradient_clipping` key (`runtime/constants.py: GRADIENT_CLIPPING_DEFAULT = 1.0`), so `deepspeed_config`
always writes the key: `grad_clip` when it is > 0, else 0 (no clipping). DINO's per-parameter clipping
(`grad_clip_per_parameter`) and its frozen last layer are `pretrain/runtime/gradient_edits.py`.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, NoReturn

import deepspeed
import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from pretrain.runtime.checkpoint import Checkpointer, run_layout, timed_step_of_checkpoint
from pretrain.runtime.compute_budget import (PFLOP, SCHEDULE_RECORD, counted_step_flops, record_schedule,
                                             schedule_length, timed_step_seconds)
from pretrain.runtime.batch_prefetch import prepared_one_ahead
from pretrain.runtime.bf16_support import bf16_is_native, emulated_bf16_warning
from pretrain.runtime.cpu_threads import configure_threads
from pretrain.runtime.distributed import finite_on_every_rank, init_distributed, with_sync_batchnorm
from pretrain.runtime.divergence import NonFiniteLoss, NonFiniteLosses
from pretrain.runtime.exit_status import check_writable, create_run_directory, first_missing_directory
from pretrain.runtime.graceful_stop import GracefulStop, StopRequested
from pretrain.runtime.gradient_edits import GradientEdits
from pretrain.runtime.monitor import TrainingMonitor
from pretrain.runtime.optim import Schedules, set_schedule_values
from pretrain.runtime.provenance import record_start
from pretrain.runtime.run_lock import locked_run_directory
from pretrain.runtime.stage import EpochLoader, LoopOptions, Stage, deepspeed_config, forward_autocast, uses_bf16
from pretrain.runtime.task import BatchLoss, BatchPosition, Scalar, TrainingTask, scalar_value
from pretrain.runtime.training_clock import TrainingClock, next_minute_mark


def initialize_engine(task: TrainingTask, optimizer: torch.optim.Optimizer, options: LoopOptions):
    """The DeepSpeed engine over `task` (placed on its device) and `optimizer`, and the gradient edits its steps apply
    (read from the optimizer's groups before DeepSpeed replaces their parameters). Returns (engine, optimizer,
    gradient_edits)."""
    edits = GradientEdits(optimizer, options.grad_clip_per_parameter, options.zero_stage)
    bf16 = uses_bf16(options, next(task.parameters()).device)
    engine, optimizer, _, _ = deepspeed.initialize(model=task, optimizer=optimizer,
                                                   config=deepspeed_config(options, bf16))
    if options.zero_stage == 0 and dist.get_world_size() == 1:
        # DeepSpeed all-reduces the gradients after every backward, one process or many: it flattens them into
        # buckets, reduces and copies them back, 30-40 ms a step of the Fashion-MNIST ResNet-18 (about a tenth of
        # the step on 2 CPU cores). Alone there is nothing to reduce: the gradients are the same without it.
        engine.enable_backward_allreduce = False
    return engine, optimizer, edits


def train_step(engine, task: TrainingTask, batch: Any, position: BatchPosition, bf16: bool = False,
               gradient_edits: GradientEdits | None = None,
               note_loss: Callable[[torch.Tensor], None] | None = None) -> BatchLoss:
    """One micro-batch: the task's loss -> [finite on every rank?] -> backward -> [last micro-batch of the step:
    gradient edits] -> engine.step (DeepSpeed steps the optimizer at the end of each gradient-accumulation cycle,
    clipping the global norm first when its config says so).

    Raises NonFiniteLoss, on every rank, before the backward of a loss that is NaN or inf on any rank: the
    parameters stay those of the last step. With `note_loss` (the loop's steps that read nothing back from the
    device: `step_reads`), the loss is handed to it instead (`NonFiniteLosses.note`) and checked later, unread here.
    """
    autocast = forward_autocast(next(engine.module.parameters()).device.type, bf16)   # a fresh region per forward
    result = task.batch_loss(engine, batch, position, autocast)
    with record_function("hardview/finite_loss_check"):
        if note_loss is not None:
            note_loss(result.loss)
        elif not finite_on_every_rank(result.loss):
            raise NonFiniteLoss(result.loss.item())
    with record_function("hardview/backward"):
        engine.backward(result.loss)
    with record_function("hardview/optimizer"):
        if gradient_edits is not None and gradient_edits.active and engine.is_gradient_accumulation_boundary():
            gradient_edits.apply(engine)
        engine.step()
    result.loss = result.loss.detach()
    return result


def run_training(stage: Stage) -> Any:
    """Run (or resume) `stage`'s training; return what `stage.finish` returns.

    Raises, on every rank: the stage's input errors (`Stage.input_errors`), CheckpointError, RunDirectoryInUse (bad
    input: nothing was trained); TrainingDiverged; StopRequested (a signal: a checkpoint was saved).
    """
    options = stage.options
    # ==== processes, run directory, seeds ====
    stage.check_inputs()                                # before any process group or worker starts
    check_writable(stage.run_dir)
    rank, world_size, device = init_distributed(options.device)
    threads = configure_threads(options.threads)              # after the launcher's LOCAL_WORLD_SIZE is known
    if rank == 0 and device.type == "cpu":
        print(f"{world_size} process(es) on the CPU, {threads} thread(s) each (engine.threads)", flush=True)
    if rank == 0 and uses_bf16(options, device) and not bf16_is_native(device):
        print(emulated_bf16_warning(device), file=sys.stderr, flush=True)
    created = first_missing_directory(stage.run_dir)    # what a refused fresh start must not leave behind
    try:
        create_run_directory(stage.run_dir)
        return train_in_run_directory(stage, rank, world_size, device)
    except stage.input_errors:                          # bad input found while building the data or the task
        if rank == 0 and created is not None and not any(created.rglob("trainer_state.json")):
            shutil.rmtree(created, ignore_errors=True)
        raise


def train_in_run_directory(stage: Stage, rank: int, world_size: int, device: torch.device) -> Any:
    """`run_training` from the run directory's lock on: prepare the run, train its epochs, finish."""
    # Signals are honoured from here on: one that arrives during the set-up stops the run after its first step.
    with GracefulStop() as stop, locked_run_directory(stage.run_dir, rank):
        run = prepare_run(stage, rank, world_size, device, stop)
        try:
            while run.step < run.stop_step and not run.out_of_time:
                train_one_epoch(run)
                run.epoch, run.batch_in_epoch = run.epoch + 1, 0
        finally:
            run.monitor.close()
        outcome = stage.finish(run.engine, run.task, run.step, run.epoch, rank)
        dist.barrier()
    return outcome


def train_one_epoch(run: Run) -> None:
    """The optimizer steps of epoch `run.epoch` from micro-batch `run.batch_in_epoch` on, to the epoch's end or the
    run's (its last step, its time budget); a stop signal saves a checkpoint and raises StopRequested."""
    options, schedules = run.options, run.schedules
    run.window = LogWindow()
    # closing(): FFCV's decode thread is stopped and joined when the loop is left early; on a GPU the next batch is
    # copied and augmented on a side stream while the step trains (pretrain/runtime/batch_prefetch.py)
    epoch_batches = run.loader.epoch(run.epoch, start_batch=run.batch_in_epoch)
    with closing(prepared_one_ahead(epoch_batches, run.device)) as batches:
        for _ in range(run.batch_in_epoch // options.grad_accum, run.steps_per_epoch):
            set_schedule_values(run.optimizer, schedules.lr[run.step], schedules.weight_decay[run.step],
                                schedules.peak_lr, run.step)
            step_values, result = optimizer_step(run, batches)     # grad_accum x (loss -> backward), step
            run.task.after_step(run.step)                          # EMA teacher, queues
            signum = agree_on_stop(run)                            # a signal on any process; the time budget
            last = run.step == run.stop_step or run.out_of_time
            epoch_end = run.batch_in_epoch == len(run.loader)
            with run.clock.paused():                               # an evaluation is not training time
                epoch_scalars = run.task.after_epoch(run.engine, run.epoch, run.step) if epoch_end or last else {}

            checkpoint = checkpoint_due(run, epoch_end, last)
            if checkpoint or signum:                               # nothing is logged or saved after a NaN loss
                check_noted_losses(run)
            log_step(run, step_values, epoch_scalars, checkpoint)     # a checkpoint's step (the last's too) is logged
            log_image_grids(run, result)
            if checkpoint:
                save_checkpoint(run)
            if last:                                               # the run is complete: a late signal changes nothing
                return
            if signum:
                stop_on_signal(run, signum)


@dataclass
class LogWindow:
    """The images trained and the seconds spent waiting for data since the last logged step (or the epoch's start):
    the throughput a logged step reports."""

    start: float = field(default_factory=time.perf_counter)
    images: int = 0
    waited: float = 0.0


@dataclass
class Run:
    """What the epoch loop trains with (built by `prepare_run`) and where it stands."""

    stage: Stage
    options: LoopOptions
    rank: int
    world_size: int
    device: torch.device
    bf16: bool                      # the task's forwards under autocast(bfloat16)
    loader: EpochLoader
    steps_per_epoch: int
    task: TrainingTask
    engine: Any                     # DeepSpeed's engine around `task`
    optimizer: torch.optim.Optimizer
    gradient_edits: GradientEdits
    schedules: Schedules
    checkpointer: Checkpointer
    monitor: TrainingMonitor
    stop: GracefulStop
    clock: TrainingClock
    stop_step: int                  # the last step: engine.max_steps, else the schedules' end
    budget_s: float                 # engine.max_minutes in seconds (0: no time budget)
    mark_s: float                   # engine.checkpoint_every_minutes in seconds (0: checkpoints at epoch ends)
    mark_steps: frozenset[int]      # engine.checkpoints_per_run's steps (empty: checkpoints at epoch ends)
    next_mark_s: float              # the training clock's next minute mark (inf: none)
    epoch: int
    batch_in_epoch: int             # the epoch's next micro-batch
    step: int                       # optimizer steps taken
    trained_seconds: float          # the training clock as every process agreed at the last step
    out_of_time: bool
    noted_losses: NonFiniteLosses   # the losses of the steps that read nothing, checked later (`step_reads`)
    window: LogWindow = field(default_factory=LogWindow)


def prepare_run(stage: Stage, rank: int, world_size: int, device: torch.device, stop: GracefulStop) -> Run:
    """The data, the schedule's length (decided here, once, for every schedule: `schedule_length`), the task, the
    optimizer and its schedules, the DeepSpeed engine, the newest checkpoint that loads (else a fresh start), the
    monitor and the training clock: the `Run` the epoch loop trains."""
    options = stage.options
    stage.check_resumable()                         # on every rank: a refused start ends all of them
    if rank == 0:
        (stage.run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    dist.barrier()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    stage.seed_generators()

    # ==== data, the schedule's length (a compute budget: counted), task, optimizer and schedules, DeepSpeed engine ====
    loader = stage.build_loader(rank, world_size, device)
    steps_per_epoch = len(loader) // options.grad_accum
    step_flops = counted_step_flops(stage, loader, steps_per_epoch, device, rank, world_size) \
        if options.budget_pflop > 0 else None
    global_batch = options.batch_size * world_size * options.grad_accum
    step_seconds, timed_now = 0.0, False
    if options.schedule_from_minutes:       # a resumed run's from its checkpoint: timing again would change it
        step_seconds = timed_step_of_checkpoint(stage.run_dir / "checkpoints")
        if not step_seconds:
            peak_lr = stage.schedules(steps_per_epoch, options.epochs * steps_per_epoch, global_batch).peak_lr
            step_seconds = timed_step_seconds(stage, loader, steps_per_epoch, device, rank,
                                              uses_bf16(options, device), peak_lr)
            timed_now = True
    # Every schedule spans these steps: the lr and weight decay, the task's own (DINO's teacher momentum), the run.
    schedule_steps = schedule_length(options.epochs, steps_per_epoch, options.budget_pflop, step_flops,
                                     60 * options.max_minutes, step_seconds)
    task = place_task(stage.build_task(steps_per_epoch, schedule_steps, device), options, world_size, device)
    schedules = stage.schedules(steps_per_epoch, schedule_steps, global_batch)
    optimizer = stage.build_optimizer(task, schedules.peak_lr)
    engine, optimizer, gradient_edits = initialize_engine(task, optimizer, options)

    # ==== resume: the newest checkpoint that loads, else a fresh start ====
    layout = run_layout(options, world_size, loader.num_images, step_flops.total if step_flops else 0, step_seconds,
                        schedule_steps)
    checkpointer = Checkpointer(engine, task, stage, layout)
    resumed_at = checkpointer.resume()
    epoch, batch_in_epoch, trained_seconds = resumed_at or (0, 0, 0.0)
    if resumed_at is not None:
        if batch_in_epoch >= len(loader):
            epoch, batch_in_epoch = epoch + 1, 0
        if rank == 0:
            print(f"resumed {stage.run_dir} at step {engine.global_steps} (epoch {epoch}, batch {batch_in_epoch})",
                  flush=True)
    else:
        stage.check_fresh_start()
    stage.record(task, steps_per_epoch, rank)
    stop_step = min(schedule_steps, options.max_steps) if options.max_steps > 0 else schedule_steps
    if rank == 0:       # every start, each resume too: what code and which machine trained from this step on
        record_start(stage.run_dir, engine.global_steps if resumed_at is not None else 0)
        record_schedule(stage.run_dir, schedule_steps, steps_per_epoch, stop_step, options.budget_pflop, step_flops,
                        step_seconds, options.max_minutes if step_seconds else 0.0)
        if step_seconds:
            timed = "timed now" if timed_now else "timed at the run's start (kept in its checkpoint)"
            print(f"time budget: {options.max_minutes:g} minutes fit {schedule_steps} optimizer steps "
                  f"({schedule_steps / steps_per_epoch:.4g} epochs) of {step_seconds:.4g} s each, {timed}; every "
                  f"schedule spans them ({stage.run_dir / SCHEDULE_RECORD})", flush=True)
        if step_flops is not None:
            print(f"compute budget: {options.budget_pflop:g} PFLOP buys {schedule_steps} optimizer steps "
                  f"({schedule_steps / steps_per_epoch:.4g} epochs) of {step_flops.total / PFLOP:.6g} PFLOP each, "
                  f"{step_flops.selection / PFLOP:.6g} of it hard view selection's (matrix products, convolutions "
                  f"and attention counted: {stage.run_dir / SCHEDULE_RECORD})", flush=True)
    monitor = TrainingMonitor(stage.run_dir, stop_step, enabled=rank == 0, print_every_steps=options.print_every_steps,
                              resumed_step=engine.global_steps if resumed_at is not None else None)
    if resumed_at is not None:
        # The resumed checkpoint's export is written again: a finished run rerun repairs a damaged
        # RUN_DIR/backbone.pth (a truncated copy, a full disk) rather than reporting "done", and a run killed
        # between a checkpoint and its export gets the export every checkpoint has (an evaluation mark's).
        task.write_export(stage.run_dir, resumed_at[0], engine.global_steps)
    engine.train()
    # A time budget (engine.max_minutes) ends the run at the first step whose agreed training clock reaches it;
    # minute marks (engine.checkpoint_every_minutes) checkpoint at the first step past each.
    budget_s, mark_s = 60 * options.max_minutes, 60 * options.checkpoint_every_minutes
    mark_steps = evenly_spaced_steps(stop_step, options.checkpoints_per_run)
    return Run(stage=stage, options=options, rank=rank, world_size=world_size, device=device,
               bf16=uses_bf16(options, device),
               loader=loader, steps_per_epoch=steps_per_epoch, task=task, engine=engine, optimizer=optimizer,
               gradient_edits=gradient_edits, schedules=schedules, checkpointer=checkpointer, monitor=monitor,
               stop=stop, clock=TrainingClock(trained_seconds), stop_step=stop_step, budget_s=budget_s, mark_s=mark_s,
               mark_steps=mark_steps,
               next_mark_s=next_minute_mark(trained_seconds, mark_s), epoch=epoch, batch_in_epoch=batch_in_epoch,
               step=engine.global_steps, trained_seconds=trained_seconds,
               out_of_time=budget_s > 0 and trained_seconds >= budget_s, noted_losses=NonFiniteLosses(device))


def place_task(task: TrainingTask, options: LoopOptions, world_size: int, device: torch.device) -> TrainingTask:
    """The task as it trains on `device`: SyncBatchNorm across several GPUs (engine.sync_batchnorm; never on CPU,
    where it raises), channels-last convolutions on GPUs (engine.channels_last: `channels_last_inputs`)."""
    task = with_sync_batchnorm(task, device, world_size, options.sync_batchnorm)
    if device.type == "cuda" and options.channels_last:
        channels_last_inputs(task)
    return task


def channels_last_inputs(module: nn.Module) -> None:
    """Every 2-D convolution of `module` reads its input in channels-last (NHWC) memory, and so computes and writes
    NHWC (a convolution runs channels-last when its input or its weight is). The weights keep their contiguous
    layout: DeepSpeed views every parameter as flat bytes (its broadcast at initialisation, ZeRO's flat groups),
    which a channels-last weight refuses (`task.to(memory_format=torch.channels_last)` failed in
    `deepspeed.initialize` on an H200: "self.stride(-1) must be 1 to view Float as Byte"). An input already
    channels-last (the previous convolution's output) is not copied."""
    def to_channels_last(_, inputs):
        return (inputs[0].contiguous(memory_format=torch.channels_last), *inputs[1:])
    for layer in module.modules():
        if isinstance(layer, nn.Conv2d):
            layer.register_forward_pre_hook(to_channels_last)


def evenly_spaced_steps(last_step: int, count: int) -> frozenset[int]:
    """The steps of `count` checkpoints evenly spaced over a run of `last_step` steps: the first step at or past each
    k / count of it, k = 1..count (the last is `last_step`); fewer when the run has fewer steps than `count`."""
    return frozenset(-(-k * last_step // count) for k in range(1, count + 1)) if count else frozenset()


def optimizer_step(run: Run, batches: Iterator[Any]) -> tuple[dict[str, list[Scalar]], BatchLoss]:
    """One optimizer step: `train_step` on each of its grad_accum micro-batches (DeepSpeed steps the optimizer after
    the last). Returns the micro-batches' values to log, unread (`log_step` reads them on the steps that log), and
    the last one's result; a non-finite loss is a divergence (raised, on every rank, before the step is applied)."""
    options = run.options
    step_values: dict[str, list[Scalar]] = {}
    reads = step_reads(run)
    if reads:
        check_noted_losses(run)                            # the steps since the last check read nothing
    note_loss = None if reads else partial(run.noted_losses.note, step=run.step + 1)
    for _ in range(options.grad_accum):
        tick = time.perf_counter()
        batch = next(batches, None)
        if batch is None:
            raise RuntimeError(f"the loader ended epoch {run.epoch} after {run.batch_in_epoch} of its "
                               f"{len(run.loader)} micro-batches")
        run.window.waited += time.perf_counter() - tick
        position = BatchPosition(options.seed, run.rank, run.epoch, run.batch_in_epoch)
        try:
            result = train_step(run.engine, run.task, batch, position, run.bf16, run.gradient_edits, note_loss)
        except NonFiniteLoss as error:
            raise run.checkpointer.diverged(f"the loss is {error.value} in step {run.step + 1}, which was not "
                                            "applied", run.epoch) from None
        run.batch_in_epoch += 1
        run.window.images += batch.batch_size * run.world_size
        for name, value in {"train/loss": result.loss, **result.scalars}.items():
            step_values.setdefault(name, []).append(value)
    run.step += 1
    if run.engine.global_steps != run.step:
        raise RuntimeError(f"DeepSpeed took {run.engine.global_steps} optimizer steps where the loop counted "
                           f"{run.step}: gradient_accumulation_steps disagrees")
    return step_values, result


def step_reads(run: Run) -> bool:
    """Whether the coming step reads values back from the device anyway, as known before it runs: it logs
    (engine.log_every_steps), checkpoints by its number (engine.checkpoint_every_steps, engine.checkpoints_per_run), is
    the last by count (engine.max_steps, the schedule's end) or ends an epoch (the epoch's evaluations). Its losses
    are checked as they are computed, before their backward (`train_step`); the other steps' are noted on the device
    (`NonFiniteLosses`) and checked at the next step that reads, or before a checkpoint that a minute mark, the time
    budget or a stop signal brings (`check_noted_losses`)."""
    step = run.step + 1
    return (step % run.options.log_every_steps == 0 or checkpoints_by_count(run, step) or step == run.stop_step
            or run.batch_in_epoch + run.options.grad_accum >= len(run.loader))


def check_noted_losses(run: Run) -> None:
    """Raise the divergence, on every rank, if a loss noted on the device since the last check was NaN or inf."""
    try:
        run.noted_losses.raise_if_any()
    except NonFiniteLoss as error:
        raise run.checkpointer.diverged(f"the loss is {error.value} in step {error.step}, found after step {run.step}: "
                                        f"steps {error.step} to {run.step} were applied, and none of them was saved",
                                        run.epoch) from None


def agree_on_stop(run: Run) -> int | None:
    """One all-reduce (none on one process): a stop signal on any process (its number), and the training clock every
    process stops and checkpoints by (`run.trained_seconds`, `run.out_of_time`)."""
    with record_function("hardview/stop_signal_check"):
        signum, run.trained_seconds = run.stop.agree(run.device, run.clock.seconds())
    run.out_of_time = run.budget_s > 0 and run.trained_seconds >= run.budget_s
    return signum


def log_step(run: Run, step_values: dict[str, list[Scalar]], epoch_scalars: dict[str, float], due: bool) -> None:
    """Every engine.log_every_steps, when `due` (a checkpoint's step, the last one's) and with an epoch's scalars: the
    step's mean over its micro-batches and over the processes (one all-reduce), the schedules' values, the
    throughput since the last logged step. The step's values are read here, on the steps that log, and only here."""
    options, step = run.options, run.step
    with record_function("hardview/logging"):
        if not (step % options.log_every_steps == 0 or due or epoch_scalars):
            return
        elapsed = time.perf_counter() - run.window.start
        averaged = {**{name: sum(map(scalar_value, values)) / options.grad_accum
                       for name, values in step_values.items()}, **run.task.scalars()}
        values = torch.tensor(list(averaged.values()), device=run.device, dtype=torch.float32)
        dist.all_reduce(values)
        run.monitor.log(step, run.epoch, {**dict(zip(averaged, (values / run.world_size).tolist())),
                                          "train/lr": float(run.schedules.lr[step - 1]),
                                          "train/weight_decay": float(run.schedules.weight_decay[step - 1]),
                                          "perf/images_per_s": run.window.images / max(elapsed, 1e-9),
                                          "perf/data_wait_frac": run.window.waited / max(elapsed, 1e-9),
                                          "perf/load_average_1min": os.getloadavg()[0],
                                          "perf/cpu_cores": os.cpu_count() or 0,
                                          "perf/cpu_threads": torch.get_num_threads(),
                                          "perf/training_seconds": run.trained_seconds,
                                          **epoch_scalars})
        run.window = LogWindow()


def log_image_grids(run: Run, result: BatchLoss) -> None:
    """Every engine.image_grid_every_steps: the images of the step's last micro-batch (hard view selection's pool
    and choice), when the task shows any."""
    every = run.options.image_grid_every_steps
    if result.images is not None and every and run.step % every == 0:
        for tag, grid in result.images().items():
            run.monitor.log_images(run.step, tag, grid)


def checkpoint_due(run: Run, epoch_end: bool, last: bool) -> bool:
    """Whether this step checkpoints: every engine.checkpoint_every_steps, at epoch ends unless minute or step marks
    replace them, at the first step past each minute mark (engine.checkpoint_every_minutes), at the steps of
    engine.checkpoints_per_run, and at the last step."""
    return (checkpoints_by_count(run, run.step) or (epoch_end and not run.mark_s and not run.mark_steps) or last
            or run.trained_seconds >= run.next_mark_s)


def checkpoints_by_count(run: Run, step: int) -> bool:
    """Whether step `step` checkpoints by its number: engine.checkpoint_every_steps, engine.checkpoints_per_run."""
    every = run.options.checkpoint_every_steps
    return bool(every and step % every == 0) or step in run.mark_steps


def save_checkpoint(run: Run) -> None:
    """A checkpoint and the task's export; its writing is not training time. Past a minute mark, the next one."""
    with record_function("hardview/checkpoint"), run.clock.paused():
        run.checkpointer.save(run.epoch, run.batch_in_epoch, run.trained_seconds)
    if run.trained_seconds >= run.next_mark_s:
        run.next_mark_s = next_minute_mark(run.trained_seconds, run.mark_s)


def stop_on_signal(run: Run, signum: int) -> NoReturn:
    """A stop signal reached some process: save this step's checkpoint (unless it was just saved), then end the run
    with StopRequested, on every rank."""
    if run.checkpointer.saved_step != run.step:
        run.checkpointer.save(run.epoch, run.batch_in_epoch, run.trained_seconds)
    raise StopRequested(f"stopped on a signal after step {run.step}, saved in "
                        f"{run.checkpointer.directory / f'step{run.step:08d}'}; rerun the same command to resume",
                        signum)
