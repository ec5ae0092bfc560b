"""The pretraining run, in one function: set-up, resume, and the training loop.

    views -> (hard view selection) -> forward -> loss -> [finite on every rank?] -> backward -> step
          -> after_step -> log / checkpoint -> [stop signal on any rank?]

Runs as one process (`python -m pretrain ...`) or several (`torchrun` / `deepspeed`); DeepSpeed ZeRO
shards optimizer state (stage 1), gradients (2) and parameters (3) across them.

Precision: weights, gradients (accumulated and all-reduced) and optimizer state are fp32 in every ZeRO
stage; `engine.precision=bf16` runs the forwards under `torch.autocast(bfloat16)`. DeepSpeed's own bf16 mode
is not used: it casts the weights to bf16 (BatchNorm then fails with bf16 weights and fp32 running
statistics), and for ZeRO stage 0 it accumulates and all-reduces gradients in bf16 (DeepSpeed 0.19 refuses
fp32 accumulation there: "unsupported mix of model_dtype=torch.bfloat16 and grad_accum_dtype=torch.float32").
"""
from __future__ import annotations

import json
import logging
import os
import random
import socket
import time
from contextlib import closing
from pathlib import Path

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn

from pretrain.checkpoint import (all_ranks_agree, check_fresh_start, check_resumable, export_backbone,
                                 parameters_finite_on_every_rank, resume_from_newest_loadable, run_layout,
                                 save_checkpoint, write_text_atomically)
from pretrain.config import ConfigError, run_dir_of, views_to_draw
from pretrain.data.loader import build_view_loader, check_training_data
from pretrain.graceful_stop import GracefulStop, StopRequested
from pretrain.hvs import Selection, select_hard_views
from pretrain.methods import build_method
from pretrain.methods.base import Method
from pretrain.monitor import TrainingMonitor
from pretrain.optim import build_optimizer, cosine_schedule, scaled_lr, set_schedule_values
from pretrain.run_lock import locked_run_directory


class TrainingDiverged(RuntimeError):
    """The loss or the parameters became NaN / inf; the message names the step and what to try."""


class NonFiniteLoss(Exception):
    def __init__(self, value: float):
        super().__init__(f"non-finite loss {value}")
        self.value = value


def init_distributed() -> tuple[int, int, torch.device]:
    """Join (or, for a plain `python -m pretrain`, create) the process group: NCCL on GPUs, gloo on CPUs."""
    if "RANK" not in os.environ:  # no launcher: a group of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    if not cuda:
        # DeepSpeed's CPU accelerator JIT-builds its shared-memory op (deepspeed_shm_comm) at the first start,
        # about 30 s under a lock in the torch extensions cache; a start killed in that window leaves the lock
        # and every later start waits on it forever. The op serves only inference_all_reduce, which training
        # never calls: mark it unavailable so that it is neither built nor loaded.
        import deepspeed.ops
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def deepspeed_config(cfg: DictConfig) -> dict:
    ds = {
        "train_micro_batch_size_per_gpu": cfg.data.batch_size,
        "gradient_accumulation_steps": cfg.optim.grad_accum,
        "zero_optimization": {"stage": cfg.engine.zero_stage},
        "zero_allow_untested_optimizer": True,   # our optimizers are plain torch ones (LARS is not DeepSpeed's)
        "steps_per_print": 1 << 30,
    }
    if cfg.optim.grad_clip > 0:
        ds["gradient_clipping"] = cfg.optim.grad_clip
    return ds


def finite_on_every_rank(loss: torch.Tensor) -> bool:
    return all_ranks_agree(bool(torch.isfinite(loss.detach()).all()))


def train_step(engine, method: Method, views: list[torch.Tensor], boxes: list[torch.Tensor], labels: torch.Tensor,
               hvs: DictConfig, rng: random.Random, bf16: bool = False) -> tuple[torch.Tensor, Selection | None]:
    """One micro-step: (hard view selection) -> forward -> loss -> backward -> optimizer step.

    views: the loader's view groups, (B, n_g, C, H_g, W_g) each, with boxes (B, n_g, 4); with selection
    every group holds its pool (hvs.num_views), without it the method's own view counts.
    Raises NonFiniteLoss, on every rank, before the backward of a loss that is NaN or inf on any rank: the
    parameters stay those of the last step.
    """
    # Two autocast regions, not one: autocast caches the bf16 copy of each weight for its whole region, and under
    # ZeRO-3, which gathers and releases the parameters around every forward, copies cached in the selection
    # forward break the training backward ("The size of tensor a (0) must match the size of tensor b").
    def autocast():
        return torch.autocast(views[0].device.type, dtype=torch.bfloat16, enabled=bf16)

    selection = None
    if hvs.enabled:
        with autocast():
            selection = select_hard_views(engine, method, views, boxes, labels, method.train_counts, hvs.mode,
                                          hvs.selection_size, hvs.max_candidates, rng)
        views = selection.views
    with autocast():
        outputs = engine(views)
    loss = method.loss({name: tensor.float() for name, tensor in outputs.items()}, labels)
    if not finite_on_every_rank(loss):
        raise NonFiniteLoss(loss.item())
    engine.backward(loss)
    engine.step()   # DeepSpeed steps the optimizer at the end of each gradient-accumulation cycle
    return loss.detach(), selection


def denormalise(views: torch.Tensor, cfg: DictConfig) -> torch.Tensor:
    mean = torch.tensor(cfg.data.mean, device=views.device).view(3, 1, 1)
    std = torch.tensor(cfg.data.std, device=views.device).view(3, 1, 1)
    return (views.float() * std + mean).clamp(0, 1)


def train(cfg: DictConfig) -> Path:
    """Run (or resume) the pretraining described by `cfg`; return the run directory.

    Raises, on every rank: ConfigError, pretrain.data.DatasetError, CheckpointError, RunDirectoryInUse (bad
    input: nothing was trained); TrainingDiverged; StopRequested (a signal: a checkpoint was saved).
    """
    # ==== processes, run directory, seeds ====
    check_training_data(cfg.data.train, cfg.data.backend)        # before any process group or worker starts
    rank, world_size, device = init_distributed()
    run_dir = run_dir_of(cfg)
    checkpoint_dir = run_dir / "checkpoints"
    # Signals are honoured from here on: one that arrives during the set-up stops the run after its first step.
    with GracefulStop() as stop, locked_run_directory(run_dir, rank):
        check_resumable(run_dir / "config.yaml", cfg)      # on every rank: a refused start ends all of them
        if rank == 0:
            checkpoint_dir.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        bf16 = cfg.engine.precision == "bf16" or (cfg.engine.precision == "auto" and device.type == "cuda")

        # ==== data: N views per image, this rank's shard, whole optimizer steps per epoch ====
        loader = build_view_loader(
            cfg.data.train, views_to_draw(cfg), cfg.data.batch_size, backend=cfg.data.backend, device=device,
            canvas_size=cfg.data.canvas_size, mean=tuple(cfg.data.mean), std=tuple(cfg.data.std),
            num_workers=cfg.data.num_workers, seed=cfg.seed, rank=rank, world_size=world_size,
            batches_per_step=cfg.optim.grad_accum, batch_design=OmegaConf.to_object(cfg.data.batch_design))
        if len(loader) == 0:
            raise ConfigError(f"{cfg.data.train} gives fewer than optim.grad_accum={cfg.optim.grad_accum} batches of "
                              f"data.batch_size={cfg.data.batch_size} per process per epoch ({loader.num_images} "
                              f"images, {world_size} processes): lower data.batch_size or optim.grad_accum")
        steps_per_epoch = len(loader) // cfg.optim.grad_accum

        # ==== method (backbone + heads + loss) ====
        method = build_method(cfg, steps_per_epoch)
        if device.type == "cuda" and world_size > 1 and cfg.engine.sync_batchnorm:
            method = nn.SyncBatchNorm.convert_sync_batchnorm(method)  # never on CPU: it raises there
        if device.type == "cuda" and cfg.engine.channels_last:
            method = method.to(memory_format=torch.channels_last)     # convolutions then run NHWC (tensor cores)

        # ==== optimizer, schedules, DeepSpeed engine ====
        global_batch = cfg.data.batch_size * world_size * cfg.optim.grad_accum
        peak_lr = scaled_lr(cfg, global_batch)
        total_steps = cfg.optim.epochs * steps_per_epoch
        lr_schedule = cosine_schedule(peak_lr, cfg.optim.min_lr, total_steps,
                                      int(cfg.optim.warmup_epochs * steps_per_epoch))
        wd_end = cfg.optim.weight_decay if cfg.optim.weight_decay_end is None else cfg.optim.weight_decay_end
        wd_schedule = cosine_schedule(cfg.optim.weight_decay, wd_end, total_steps)
        optimizer = build_optimizer(cfg, method.param_groups(), peak_lr)
        engine, optimizer, _, _ = deepspeed.initialize(model=method, optimizer=optimizer,
                                                       config=deepspeed_config(cfg))

        # ==== resume: the newest checkpoint that loads, else a fresh start ====
        start_epoch, start_batch = 0, 0
        resumed = resume_from_newest_loadable(engine, checkpoint_dir, run_layout(cfg, world_size, loader.num_images))
        if resumed is not None:
            trainer_state, client_state = resumed
            start_epoch, start_batch = trainer_state["epoch"], trainer_state["batch_in_epoch"]
            method.load_state_outside_engine(client_state.get("method", {}))
            if start_batch >= len(loader):
                start_epoch, start_batch = start_epoch + 1, 0
            if rank == 0:
                print(f"resumed {run_dir} at step {engine.global_steps} (epoch {start_epoch}, batch {start_batch})",
                      flush=True)
        else:
            check_fresh_start(run_dir)
        if rank == 0:   # only now: a run refused above must not overwrite the record of the run it clashed with
            write_text_atomically(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        stop_step = min(total_steps, cfg.engine.max_steps) if cfg.engine.max_steps > 0 else total_steps
        monitor = TrainingMonitor(run_dir, stop_step, enabled=rank == 0,
                                  print_every_steps=cfg.engine.print_every_steps,
                                  resumed_step=engine.global_steps if resumed is not None else None)
        saved_step = engine.global_steps if resumed is not None else None

        def checkpoint(epoch: int, batch_in_epoch: int) -> None:
            nonlocal saved_step
            step = engine.global_steps
            if not parameters_finite_on_every_rank(engine.module):
                raise TrainingDiverged(diverged(f"the parameters are NaN or inf after step {step}", epoch))
            save_checkpoint(engine, checkpoint_dir,
                            {"step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch,
                             **run_layout(cfg, world_size, loader.num_images)},
                            {"method": method.state_outside_engine()}, cfg.engine.keep_checkpoints)
            export_backbone(engine.module, run_dir, cfg, epoch, step)
            saved_step = step

        def diverged(what: str, epoch: int) -> str:
            kept = (f"The last checkpoint ({checkpoint_dir / f'step{saved_step:08d}'}) and backbone.pth, both of "
                    f"step {saved_step}, are finite and kept; rerunning with this run directory resumes from "
                    "there" if saved_step is not None else
                    "No checkpoint had been saved yet; rerunning with this run directory starts afresh")
            return (f"training diverged in epoch {epoch}: {what}. {kept}. Try a lower optim.lr (now "
                    f"{cfg.optim.lr}), gradient clipping (optim.grad_clip=1.0) or a longer warm-up "
                    f"(optim.warmup_epochs, now {cfg.optim.warmup_epochs}).")

        # ==== training loop ====
        engine.train()
        epoch = start_epoch
        try:
            while epoch < cfg.optim.epochs and engine.global_steps < stop_step:
                waited, images, step_sums = 0.0, 0, {}
                tick = window_start = time.perf_counter()
                batch_index = start_batch
                # closing(): FFCV's decode thread is stopped and joined when the loop is left early
                with closing(loader.epoch(epoch, start_batch=start_batch)) as batches:
                    for batch in batches:
                        step = engine.global_steps            # optimizer steps taken before this micro-batch
                        waited += time.perf_counter() - tick
                        set_schedule_values(optimizer, lr_schedule[step], wd_schedule[step], peak_lr, step)
                        rng = random.Random(f"{cfg.seed}-{rank}-{epoch}-{batch_index}")  # candidates, reproducible
                        try:
                            loss, selection = train_step(engine, method, batch.views, batch.boxes, batch.labels,
                                                         cfg.hvs, rng, bf16)
                        except NonFiniteLoss as error:
                            raise TrainingDiverged(diverged(f"the loss is {error.value} in step {step + 1}, "
                                                            "which was not applied", epoch)) from None
                        batch_index += 1
                        images += batch.batch_size * world_size
                        for name, value in {"train/loss": loss.item(),
                                            **(selection.stats if selection is not None else {})}.items():
                            step_sums[name] = step_sums.get(name, 0.0) + value
                        if engine.global_steps == step:      # inside a gradient-accumulation cycle
                            tick = time.perf_counter()
                            continue
                        method.after_step(engine.global_steps)
                        done = engine.global_steps

                        # ---- logging: the step's mean over its micro-batches and over the processes ----
                        if done % cfg.engine.log_every_steps == 0 or done == stop_step:
                            elapsed = time.perf_counter() - window_start
                            averaged = {**{name: total / cfg.optim.grad_accum for name, total in step_sums.items()},
                                        **method.scalars()}
                            values = torch.tensor(list(averaged.values()), device=device, dtype=torch.float32)
                            dist.all_reduce(values)
                            scalars = {**dict(zip(averaged, (values / world_size).tolist())),
                                       "train/lr": float(lr_schedule[step]),
                                       "train/weight_decay": float(wd_schedule[step]),
                                       "perf/images_per_s": images / max(elapsed, 1e-9),
                                       "perf/data_wait_frac": waited / max(elapsed, 1e-9)}
                            monitor.log(done, epoch, scalars)
                            waited, images, window_start = 0.0, 0, time.perf_counter()
                        step_sums = {}
                        if selection is not None and cfg.engine.image_grid_every_steps and \
                                done % cfg.engine.image_grid_every_steps == 0:
                            shown = min(8, batch.batch_size)
                            monitor.log_images(done, "hvs/pool", denormalise(batch.views[0][:shown], cfg))
                            monitor.log_images(done, "hvs/selected", denormalise(selection.views[0][:shown], cfg))

                        # ---- checkpoint; stop on a signal ----
                        every = cfg.engine.checkpoint_every_steps
                        if (every and done % every == 0) or done == stop_step:
                            checkpoint(epoch, batch_index)
                        if done >= stop_step:           # the run is complete: a late signal changes nothing
                            break
                        signum = stop.requested_on_any_rank(device)
                        if signum:
                            if saved_step != done:
                                checkpoint(epoch, batch_index)
                            raise StopRequested(f"stopped on a signal after step {done}, saved in "
                                                f"{checkpoint_dir / f'step{done:08d}'}; rerun the same command "
                                                "to resume", signum)
                        tick = time.perf_counter()
                    else:   # the epoch ran out: its end is always a checkpoint
                        if engine.global_steps != saved_step:
                            checkpoint(epoch, batch_index)
                epoch, start_batch = epoch + 1, 0
        finally:
            monitor.close()

        if rank == 0:
            print(f"done: {run_dir} at step {engine.global_steps}; backbone export {run_dir / 'backbone.pth'}",
                  flush=True)
            write_text_atomically(run_dir / "finished.json", json.dumps({"step": engine.global_steps, "epoch": epoch}))
        dist.barrier()
    return run_dir
