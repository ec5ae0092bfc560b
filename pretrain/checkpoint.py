"""Checkpoints: DeepSpeed checkpoints to resume a run, and the backbone export that eval and transfer read.

RUN_DIR/checkpoints/stepNNNNNNNN/   DeepSpeed shards (model, optimizer, per rank) + our client state
RUN_DIR/checkpoints/latest          written by DeepSpeed once a checkpoint is complete
RUN_DIR/backbone.pth                {arch, stem, state_dict, config, epoch, step}; torch.load(weights_only=True)
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as it is; the message says why and what to do."""


def average_buffers(module: nn.Module) -> None:
    """All-reduce (mean) floating-point buffers such as BatchNorm running statistics: DeepSpeed broadcasts
    parameters once at start but never buffers, so without SyncBatchNorm they drift apart between ranks."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    for buffer in module.buffers():
        if buffer.is_floating_point():
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
            buffer.div_(dist.get_world_size())


def save_checkpoint(engine, checkpoint_dir: Path, step: int, client_state: dict, keep: int) -> None:
    """Save a DeepSpeed checkpoint tagged `stepNNNNNNNN`; keep the newest `keep` of them."""
    average_buffers(engine.module)
    engine.save_checkpoint(str(checkpoint_dir), tag=f"step{step:08d}", client_state=client_state)
    if dist.get_rank() == 0 and keep > 0:
        tags = sorted(p for p in checkpoint_dir.glob("step*") if p.is_dir())
        for old in tags[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def resume_if_possible(engine, checkpoint_dir: Path) -> dict | None:
    """Load the latest checkpoint of the run, if there is one; return its client state."""
    latest = checkpoint_dir / "latest"
    if not latest.is_file():
        return None
    tag = latest.read_text().strip()
    if not (checkpoint_dir / tag).is_dir():
        raise CheckpointError(f"{latest} names checkpoint {tag!r}, which is missing; write the name of a complete "
                              f"checkpoint directory of {checkpoint_dir} into it, or delete it to start afresh")
    try:
        path, client_state = engine.load_checkpoint(str(checkpoint_dir), tag=tag)
    except (RuntimeError, KeyError, ValueError, AssertionError) as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        raise CheckpointError(
            f"cannot resume from {checkpoint_dir / tag}: it does not match this run's model or optimizer "
            f"({reason}). Start a new run (a different `name=`), or delete {checkpoint_dir} to start this one "
            "from scratch.") from None
    if path is None:
        raise CheckpointError(f"checkpoint {checkpoint_dir / tag} is incomplete; write the name of an older "
                              f"checkpoint into {latest}, or delete it to start afresh")
    return client_state


def check_resumable(saved_config_path: Path, cfg: DictConfig) -> None:
    """Refuse to resume a run directory written by a different model / method (a likely mistake)."""
    if not saved_config_path.is_file():
        return
    saved = OmegaConf.load(saved_config_path)
    for key in ("model.arch", "model.stem", "method.name", "model.proj_out_dim"):
        old, new = OmegaConf.select(saved, key), OmegaConf.select(cfg, key)
        if old != new:
            raise CheckpointError(
                f"{saved_config_path.parent} holds a run with {key}={old!r}, but this config has {key}={new!r}. "
                "Use another run name (name=...) or delete that directory.")


def export_backbone(module: nn.Module, path: Path, cfg: DictConfig, epoch: int, step: int) -> None:
    """Write {arch, stem, state_dict, config, epoch, step} for the evaluation and transfer stages.

    The backbone is the method's `backbone_to_export()` (DINO: the teacher's, unless method.export=student).
    Every rank must call this (ZeRO-3 gathers the partitioned parameters); rank 0 writes the file,
    atomically, so a reader never sees half a file.
    """
    backbone = module.backbone_to_export()
    with deepspeed.zero.GatheredParameters(list(backbone.parameters()), modifier_rank=None):
        if dist.get_rank() == 0:
            state = {name: (t.float() if t.is_floating_point() else t).detach().cpu().clone()
                     for name, t in backbone.state_dict().items()}
            export = {"arch": cfg.model.arch, "stem": cfg.model.stem, "state_dict": state,
                      "config": OmegaConf.to_container(cfg, resolve=True), "epoch": epoch, "step": step}
            tmp = path.with_suffix(".pth.tmp")
            torch.save(export, tmp)
            os.replace(tmp, path)
    dist.barrier()
