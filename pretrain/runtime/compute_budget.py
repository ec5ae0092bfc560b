"""The length of a run's schedule, decided once (`schedule_length`): optim.epochs x steps per epoch, the optimizer
steps that a compute budget buys (optim.budget_pflop, counted FLOPs), or those that a time budget fits at a step time
measured at the start (optim.schedule_from_minutes with engine.max_minutes).

Why a budget in counted compute: a wall-clock budget (engine.max_minutes) with a schedule sized in epochs from an
earlier speed is not equal compute, and its schedule does not end at the budget (the Fashion-MNIST selection study
cut SimCLR's cosine at 73-88% of its steps, its lr still 9-17% of the peak). A compute budget fixes the steps
instead: at its start the run counts the floating-point operations of one optimizer step (`count_micro_batch_flops`,
`counted_step_flops`), and every schedule -- the lr and weight decay (`schedules_from_config`), the task's own (DINO's
teacher momentum and temperature), the run's end -- spans floor(budget / FLOPs per step) steps; the last epoch may be
partial, and the run ends there as a finished one.

What is counted (torch.utils.flop_counter.FlopCounterMode): matrix products (mm, addmm, bmm, baddbmm), convolutions
(forward and backward) and attention, 2 FLOPs per multiply-add. Elementwise operations, normalisation, pooling, the
augmentation, the optimizer's update and the communication between processes are NOT counted. One micro-batch of
the run's own loader (its exact shapes) goes through the task's `batch_loss` -- hard view selection's scoring pass
when hvs.enabled, the forward, the loss, the online monitors -- and the backward; times optim.grad_accum micro-batches,
times the processes (each computes its share of the global batch). The scoring pass is what is counted before the
forward that the loss backpropagates through (the first forward with gradients on), recorded apart.

The count depends on shapes only, so every machine counts the same: it runs in fp32 without autocast (bf16 changes
no shape) and with attention in its math form (`SDPBackend.MATH`: FlopCounterMode has no formula for the CPU's fused
attention kernel, which it would count as 0). It runs on a task built for the count (`Stage.build_task`) with the
random generators restored after it, so that nothing the run trains, no buffer (BatchNorm statistics, EMA teachers,
queues) and no random draw of the run changes. A fresh task's step is what is counted: s-MoCo's queue is empty then
(its similarities to the queue are left out), and work a task does only on some steps (s-MoCo's drift probe) is not
in it.

A time budget sized by a timed step (optim.schedule_from_minutes): the schedules span floor(engine.max_minutes x 60 /
the seconds of one optimizer step), the step timed at the start (`timed_step_seconds`) on a task built for it, as the
count is: one micro-batch untimed (compilation, allocation, the loader's workers starting), then TIMED_MICRO_BATCHES
timed, each from the wait for its batch to the optimizer's update (on several processes the gradients' reduction
too, as one flat all-reduce), in the run's precision, times optim.grad_accum; the slowest process's time. Not timed:
DeepSpeed's own work around the step (its buckets, ZeRO's partitions) and the work of the steps that log. The machine's speed moves during a run (20% between runs of the Fashion-MNIST study), so the run
still ends at whichever comes first, its schedule's end or its minutes; `launch benchmark` flags a run that trained
less than 95% of its schedule or of its minutes. The measured time is kept in the checkpoint: a resumed run takes it
from there rather than timing again (another time would be another schedule).

RUN_DIR/schedule.json, written on rank 0 at every start (`record_schedule`), says how long the schedule is and what
decided it; its readers are the benchmark's table (launch/benchmark_results.py: the share of its schedule each run
trained, the PFLOP it trained). The checkpoint's run layout (pretrain/runtime/checkpoint.py) keeps the budget and the
count, so a resumed run, which counts again, is refused when either differs: it would train another schedule.
"""
from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from pretrain.runtime.atomic_write import write_text_atomically
from pretrain.runtime.config_error import ConfigError
from pretrain.runtime.stage import forward_autocast
from pretrain.runtime.task import BatchPosition, TrainingTask

PFLOP = 10 ** 15
SCHEDULE_RECORD = "schedule.json"
COUNTED_BY = ("torch.utils.flop_counter.FlopCounterMode: matrix products, convolutions and attention (2 FLOPs per "
              "multiply-add); elementwise operations, normalisation and the optimizer's update not counted")


@dataclass(frozen=True)
class StepFlops:
    """Counted FLOPs of one micro-batch on one process, or of a whole optimizer step (`times`): hard view selection's
    scoring pass and the training step (forward, loss, backward)."""

    selection: int
    training: int

    @property
    def total(self) -> int:
        return self.selection + self.training

    def times(self, count: int) -> StepFlops:
        return StepFlops(self.selection * count, self.training * count)


def count_micro_batch_flops(task: TrainingTask, batch, position: BatchPosition) -> StepFlops:
    """The FLOPs (see the module docstring for what is counted) of `task.batch_loss` on `batch` and its backward, the
    task standing in for the DeepSpeed engine (which adds no matrix product: ZeRO's gathers and reductions are
    communication). The task runs as in training (its BatchNorm statistics, teachers, queues and online probe move):
    give it one the run does not train (`counted_step_flops` builds one)."""
    task.train()
    training_starts: list[int] = []

    def note_training_forward(module, inputs):
        if torch.is_grad_enabled() and not training_starts:
            training_starts.append(counter.get_total_flops())

    hook = task.register_forward_pre_hook(note_training_forward)
    try:
        with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
            result = task.batch_loss(task, batch, position, nullcontext)
            result.loss.backward()
    finally:
        hook.remove()
    total = counter.get_total_flops()
    selection = training_starts[0] if training_starts else 0
    return StepFlops(selection=selection, training=total - selection)


@contextmanager
def random_generators_restored(device: torch.device) -> Iterator[None]:
    """Python's, numpy's and torch's generators (the CPU's and `device`'s) as they were after the block: a block that
    builds a model or seeds per batch (fine-tuning's `batch_loss`) leaves the run's draws as they would have been."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def counted_step_flops(stage, loader, steps_per_epoch: int, device: torch.device, rank: int,
                       world_size: int) -> StepFlops:
    """The FLOPs of one optimizer step of `stage`'s run: one micro-batch of `loader` (epoch 0's first, the shapes
    every step has) through a task built for the count, times optim.grad_accum, times `world_size`. The task the run
    trains is built afterwards, from the same random state (`random_generators_restored`)."""
    options = stage.options
    with random_generators_restored(device):
        task = stage.build_task(steps_per_epoch, 1, device).to(device)   # its schedules' length counts nothing
        with closing(loader.epoch(0)) as batches:
            batch = next(batches)
        flops = count_micro_batch_flops(task, batch, BatchPosition(options.seed, rank, 0, 0))
        del task, batch
    return flops.times(options.grad_accum * world_size)


def budgeted_steps(budget_pflop: float, step: StepFlops) -> int:
    """The optimizer steps `budget_pflop` buys: floor(budget / FLOPs per step). A budget within 1e-12 of a whole
    number of steps buys that number (a decimal budget's binary rounding must not cost a step). Refused (ConfigError)
    when it buys none, naming the count and the least budget that buys one."""
    if step.total <= 0:
        raise ConfigError(f"optim.budget_pflop={budget_pflop:g}: one optimizer step of this run counts 0 FLOPs "
                          "(FlopCounterMode counts matrix products, convolutions and attention, and the step ran "
                          "none), so a compute budget cannot size it; set optim.budget_pflop=0 and size it with "
                          "optim.epochs")
    steps = math.floor(budget_pflop * PFLOP / step.total * (1 + 1e-12))
    if steps < 1:
        unit = 10 ** max(len(str(step.total)) - 6, 0)          # the count rounded up to 6 significant digits
        least = -(-step.total // unit) * unit / PFLOP
        raise ConfigError(f"optim.budget_pflop={budget_pflop:g} buys no optimizer step: one step counts "
                          f"{step.total:,} FLOPs ({step.total / PFLOP:.6g} PFLOP); set optim.budget_pflop to at least "
                          f"{least:g}")
    return steps


def schedule_length(epochs: int, steps_per_epoch: int, budget_pflop: float, step: StepFlops | None,
                    budget_s: float = 0.0, step_seconds: float = 0.0) -> int:
    """The optimizer steps every schedule of the run spans: with a compute budget (> 0), what it buys at `step`'s
    count (`budgeted_steps`); with a timed step (`step_seconds` > 0), the steps that fit in `budget_s` at that time,
    at least one; else `epochs` x `steps_per_epoch`."""
    if budget_pflop > 0:
        if step is None:
            raise ValueError("a compute budget needs the count of a step: counted_step_flops")
        return budgeted_steps(budget_pflop, step)
    if step_seconds > 0:
        return max(1, math.floor(budget_s / step_seconds))
    return epochs * steps_per_epoch


TIMED_MICRO_BATCHES = 3


def timed_step_seconds(stage, loader, steps_per_epoch: int, device: torch.device, rank: int, bf16: bool,
                       peak_lr: float) -> float:
    """The seconds of one optimizer step of `stage`'s run (the module docstring says what is timed): epoch 0's first
    micro-batches through a task and an optimizer built for the measure, the random generators restored after it;
    the slowest process's time (one all-reduce)."""
    options = stage.options
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    with random_generators_restored(device):
        task = stage.build_task(steps_per_epoch, 1, device).to(device)
        optimizer = stage.build_optimizer(task, peak_lr)
        task.train()
        autocast = forward_autocast(device.type, bf16)
        seconds = []
        with closing(loader.epoch(0)) as batches:
            for index in range(1 + TIMED_MICRO_BATCHES):
                started = time.perf_counter()
                batch = next(batches, None)
                if batch is None:            # an epoch shorter than the measure: what was timed
                    break
                result = task.batch_loss(task, batch, BatchPosition(options.seed, rank, 0, index), autocast)
                result.loss.backward()
                if distributed:              # the gradients' reduction, one flat all-reduce (DeepSpeed buckets them)
                    grads = [p.grad for p in task.parameters() if p.grad is not None]
                    flat = torch.cat([g.flatten() for g in grads])
                    dist.all_reduce(flat)
                    for grad, reduced in zip(grads, flat.split([g.numel() for g in grads])):
                        grad.copy_(reduced.view_as(grad)).div_(dist.get_world_size())
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if index > 0:
                    seconds.append(time.perf_counter() - started)
        del task, optimizer, batch, result
    step_s = torch.tensor([options.grad_accum * (sum(seconds) / len(seconds) if seconds else 0.0)],
                          dtype=torch.float64, device=device)
    if distributed:
        dist.all_reduce(step_s, op=dist.ReduceOp.MAX)
    if not step_s.item() > 0:
        raise ConfigError("optim.schedule_from_minutes=true: the training set has too few micro-batches to time a "
                          f"step ({1 + TIMED_MICRO_BATCHES} needed, the first one untimed); size the schedule with "
                          "optim.epochs (optim.schedule_from_minutes=false)")
    return step_s.item()


def record_schedule(run_dir: Path, schedule_steps: int, steps_per_epoch: int, last_step: int, budget_pflop: float,
                    step: StepFlops | None, step_seconds: float = 0.0, budget_minutes: float = 0.0) -> None:
    """Write RUN_DIR/schedule.json (rank 0, at every start; a resumed run's holds the same schedule, the layout check
    saw to it): `schedule_steps`, the optimizer steps every schedule spans; `steps_per_epoch`, the loader's;
    `last_step`, where the run ends unless a time budget or a signal stops it first (engine.max_steps may end it
    before its schedule); `budget_pflop`, the compute budget (0: none, the schedule is optim.epochs');
    `flops_per_step`, the count of one optimizer step of the whole run, {selection, training, total} (null: not
    counted, without a budget), and what counted it; `sized_by` (epochs, pflop or minutes) and, sized by minutes,
    `step_seconds`, the timed step, and `budget_minutes`, engine.max_minutes."""
    sized_by = "pflop" if budget_pflop > 0 else "minutes" if step_seconds > 0 else "epochs"
    record = {"schedule_steps": schedule_steps, "steps_per_epoch": steps_per_epoch, "last_step": last_step,
              "sized_by": sized_by, "budget_pflop": budget_pflop,
              **({"step_seconds": step_seconds, "budget_minutes": budget_minutes} if sized_by == "minutes" else {}),
              "flops_per_step": None if step is None else {**asdict(step), "total": step.total},
              "counted_by": None if step is None else COUNTED_BY}
    write_text_atomically(run_dir / SCHEDULE_RECORD, json.dumps(record, indent=1) + "\n")


def read_schedule(run_dir: Path) -> dict | None:
    """RUN_DIR/schedule.json as written by `record_schedule`; None for a run that has none (trained before it was
    written)."""
    path = run_dir / SCHEDULE_RECORD
    return json.loads(path.read_text()) if path.is_file() else None
