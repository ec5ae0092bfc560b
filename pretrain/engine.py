"""The pretraining run, in one function: set-up, resume, and the training loop.

    views -> (hard view selection) -> forward -> loss -> backward -> step -> after_step -> log / checkpoint

Runs as one process (`python -m pretrain ...`) or several (`torchrun` / `deepspeed`); DeepSpeed ZeRO
shards optimizer state (stage 1), gradients (2) and parameters (3) across them.
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

from pretrain.checkpoint import check_resumable, export_backbone, resume_if_possible, save_checkpoint
from pretrain.config import ConfigError, run_dir_of, views_to_draw
from pretrain.data.loader import build_view_loader
from pretrain.hvs import Selection, select_hard_views
from pretrain.methods import build_method
from pretrain.methods.base import Method
from pretrain.monitor import TrainingMonitor
from pretrain.optim import build_optimizer, cosine_schedule, scaled_lr, set_schedule_values


def init_distributed() -> tuple[int, int, torch.device]:
    """Join (or, for a plain `python -m pretrain`, create) the process group: NCCL on GPUs, gloo on CPUs."""
    if "RANK" not in os.environ:  # no launcher: a group of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def deepspeed_config(cfg: DictConfig, bf16: bool) -> dict:
    ds = {
        "train_micro_batch_size_per_gpu": cfg.data.batch_size,
        "gradient_accumulation_steps": cfg.optim.grad_accum,
        "zero_optimization": {"stage": cfg.engine.zero_stage},
        "bf16": {"enabled": bf16},
        "zero_allow_untested_optimizer": True,   # our optimizers are plain torch ones (LARS is not DeepSpeed's)
        "steps_per_print": 1 << 30,
    }
    if cfg.optim.grad_clip > 0:
        ds["gradient_clipping"] = cfg.optim.grad_clip
    return ds


def train_step(engine, method: Method, views: list[torch.Tensor], boxes: list[torch.Tensor], labels: torch.Tensor,
               hvs: DictConfig, rng: random.Random) -> tuple[torch.Tensor, Selection | None]:
    """One micro-step: (hard view selection) -> forward -> loss -> backward -> optimizer step.

    views: the loader's view groups, (B, n_g, C, H_g, W_g) each, with boxes (B, n_g, 4); with selection
    every group holds its pool (hvs.num_views), without it the method's own view counts.
    """
    selection = None
    if hvs.enabled:
        selection = select_hard_views(engine, method, views, boxes, labels, method.train_counts, hvs.mode,
                                      hvs.selection_size, hvs.max_candidates, rng)
        views = selection.views
    outputs = {name: tensor.float() for name, tensor in engine(views).items()}
    loss = method.loss(outputs, labels)
    engine.backward(loss)
    engine.step()   # DeepSpeed steps the optimizer at the end of each gradient-accumulation cycle
    return loss.detach(), selection


def denormalise(views: torch.Tensor, cfg: DictConfig) -> torch.Tensor:
    mean = torch.tensor(cfg.data.mean, device=views.device).view(3, 1, 1)
    std = torch.tensor(cfg.data.std, device=views.device).view(3, 1, 1)
    return (views.float() * std + mean).clamp(0, 1)


def train(cfg: DictConfig) -> Path:
    """Run (or resume) the pretraining described by `cfg`; return the run directory."""
    # ==== processes, run directory, seeds ====
    if not Path(cfg.data.train).exists():
        raise FileNotFoundError(f"data.train={cfg.data.train!r} does not exist: write it first with "
                                "`python -m pretrain.data write --image-folder DIR --out FILE.beton` "
                                "(or `python -m pretrain.data write-digits --out-dir data/digits`)")
    rank, world_size, device = init_distributed()
    run_dir = run_dir_of(cfg)
    checkpoint_dir = run_dir / "checkpoints"
    if rank == 0:
        check_resumable(run_dir / "config.yaml", cfg)
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    bf16 = cfg.engine.precision == "bf16" or (cfg.engine.precision == "auto" and device.type == "cuda")

    # ==== data: N views per image, this rank's shard ====
    groups = views_to_draw(cfg)
    loader = build_view_loader(
        cfg.data.train, groups, cfg.data.batch_size, backend=cfg.data.backend, device=device,
        canvas_size=cfg.data.canvas_size, mean=tuple(cfg.data.mean), std=tuple(cfg.data.std),
        num_workers=cfg.data.num_workers, seed=cfg.seed, rank=rank, world_size=world_size)
    if len(loader) < cfg.optim.grad_accum:
        raise ConfigError(f"{cfg.data.train} gives {len(loader)} batches of {cfg.data.batch_size} per process per "
                         f"epoch, fewer than optim.grad_accum={cfg.optim.grad_accum}; lower data.batch_size")

    # ==== method (backbone + heads + loss) ====
    method = build_method(cfg, len(loader) // cfg.optim.grad_accum)
    if device.type == "cuda" and world_size > 1 and cfg.engine.sync_batchnorm:
        method = nn.SyncBatchNorm.convert_sync_batchnorm(method)  # never on CPU: it raises there

    # ==== optimizer, schedules, DeepSpeed engine ====
    global_batch = cfg.data.batch_size * world_size * cfg.optim.grad_accum
    peak_lr = scaled_lr(cfg, global_batch)
    steps_per_epoch = len(loader) // cfg.optim.grad_accum
    total_steps = cfg.optim.epochs * steps_per_epoch
    lr_schedule = cosine_schedule(peak_lr, cfg.optim.min_lr, total_steps, int(cfg.optim.warmup_epochs * steps_per_epoch))
    wd_end = cfg.optim.weight_decay if cfg.optim.weight_decay_end is None else cfg.optim.weight_decay_end
    wd_schedule = cosine_schedule(cfg.optim.weight_decay, wd_end, total_steps)
    optimizer = build_optimizer(cfg, method.param_groups(), peak_lr)
    engine, optimizer, _, _ = deepspeed.initialize(model=method, optimizer=optimizer,
                                                   config=deepspeed_config(cfg, bf16))
    dtype = torch.bfloat16 if bf16 else torch.float32

    # ==== resume ====
    start_epoch, start_batch = 0, 0
    client_state = resume_if_possible(engine, checkpoint_dir)
    if client_state is not None:
        start_epoch, start_batch = client_state["epoch"], client_state["batch_in_epoch"]
        method.load_state_outside_engine(client_state.get("method", {}))
        if start_batch >= len(loader):
            start_epoch, start_batch = start_epoch + 1, 0
        if rank == 0:
            print(f"resumed {run_dir} at step {engine.global_steps} (epoch {start_epoch}, batch {start_batch})",
                  flush=True)
    if rank == 0:   # only now: a run refused above must not overwrite the record of the run it clashed with
        OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    stop_step = min(total_steps, cfg.engine.max_steps) if cfg.engine.max_steps > 0 else total_steps
    monitor = TrainingMonitor(run_dir, stop_step, enabled=rank == 0, print_every_steps=cfg.engine.print_every_steps,
                              resumed_step=engine.global_steps if client_state is not None else None)

    saved_step = engine.global_steps

    def checkpoint(epoch: int, batch_in_epoch: int) -> None:
        nonlocal saved_step
        step = saved_step = engine.global_steps
        save_checkpoint(engine, checkpoint_dir, step,
                        {"epoch": epoch, "batch_in_epoch": batch_in_epoch, "step": step,
                         "method": method.state_outside_engine()},
                        cfg.engine.keep_checkpoints)
        export_backbone(engine.module, run_dir / "backbone.pth", cfg, epoch, step)

    # ==== training loop ====
    engine.train()
    epoch = start_epoch
    while epoch < cfg.optim.epochs and engine.global_steps < stop_step:
        waited, images = 0.0, 0
        tick = window_start = time.perf_counter()
        batch_index = start_batch
        # closing(): FFCV's decode thread is stopped and joined when the loop is left early (max_steps, an error)
        with closing(loader.epoch(epoch, start_batch=start_batch)) as batches:
            for batch in batches:
                step = engine.global_steps
                waited += time.perf_counter() - tick
                set_schedule_values(optimizer, lr_schedule[step], wd_schedule[step], peak_lr, step)
                rng = random.Random(f"{cfg.seed}-{rank}-{step}")    # candidate sampling, reproducible on resume
                loss, selection = train_step(engine, method, [v.to(dtype) for v in batch.views], batch.boxes,
                                             batch.labels, cfg.hvs, rng)
                batch_index += 1
                images += batch.batch_size * world_size
                if engine.global_steps == step:      # inside a gradient-accumulation cycle
                    tick = time.perf_counter()
                    continue
                method.after_step(engine.global_steps)

                # ---- logging ----
                if step % cfg.engine.log_every_steps == 0 or engine.global_steps == stop_step:
                    elapsed = time.perf_counter() - window_start
                    # Averaged over processes in one all-reduce: the loss, the method's and the selection's scalars.
                    averaged = {"train/loss": loss.item(), **method.scalars(),
                                **(selection.stats if selection is not None else {})}
                    values = torch.tensor(list(averaged.values()), device=device, dtype=torch.float32)
                    dist.all_reduce(values)
                    scalars = {**dict(zip(averaged, (values / world_size).tolist())),
                               "train/lr": float(lr_schedule[step]),
                               "train/weight_decay": float(wd_schedule[step]),
                               "perf/images_per_s": images / max(elapsed, 1e-9),
                               "perf/data_wait_frac": waited / max(elapsed, 1e-9)}
                    monitor.log(engine.global_steps, epoch, scalars)
                    waited, images, window_start = 0.0, 0, time.perf_counter()
                if selection is not None and cfg.engine.image_grid_every_steps and \
                        step % cfg.engine.image_grid_every_steps == 0:
                    shown = min(8, batch.batch_size)
                    monitor.log_images(engine.global_steps, "hvs/pool", denormalise(batch.views[0][:shown], cfg))
                    monitor.log_images(engine.global_steps, "hvs/selected",
                                       denormalise(selection.views[0][:shown], cfg))

                # ---- checkpoint ----
                every = cfg.engine.checkpoint_every_steps
                if (every and engine.global_steps % every == 0) or engine.global_steps == stop_step:
                    checkpoint(epoch, batch_index)
                if engine.global_steps >= stop_step:
                    break
                tick = time.perf_counter()
            else:   # the epoch ran out: its end is always a checkpoint
                if engine.global_steps != saved_step:
                    checkpoint(epoch, batch_index)
        epoch, start_batch = epoch + 1, 0

    monitor.close()
    if rank == 0:
        print(f"done: {run_dir} at step {engine.global_steps}; backbone export {run_dir / 'backbone.pth'}", flush=True)
        (run_dir / "finished.json").write_text(json.dumps({"step": engine.global_steps, "epoch": epoch}))
    dist.barrier()
    return run_dir
