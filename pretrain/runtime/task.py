"""What a stage that trains supplies to the training loop (`pretrain/runtime/loop.py`): a `TrainingTask`.

The task is the module the DeepSpeed engine wraps: its parameters are what the optimizer steps, and it says
how a batch becomes a loss. Pretraining's methods are tasks (`pretrain.methods.base.Method`: views -> hard
view selection -> forward -> loss), and so are fine-tuning's classifier (images -> logits -> cross-entropy)
and detection's detector (images + boxes -> losses).

    batch_loss(engine, batch, position, autocast) -> BatchLoss   the loss of one micro-batch, through `engine`
    param_groups() -> [dict, ...]             optimizer groups; flags: no_decay, fixed_lr, frozen_steps, lr_scale
    after_step(step)                          EMA teacher / queue updates, once per optimizer step
    after_epoch(engine, epoch, step) -> {name: float}   at the last step of an epoch, and of the run:
                                              fine-tuning's validation; the scalars are logged with that step
    scalars() -> {name: float}                task-specific values to log (e.g. tcl/grad_pos), averaged over ranks
    state_outside_engine() / load_state_outside_engine(state)   what DeepSpeed does not checkpoint
    write_export(run_dir, epoch, step)        at every checkpoint, on every rank: what other stages read
                                              (pretraining: the backbone export)
"""
from __future__ import annotations

import random
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn


@dataclass(frozen=True)
class BatchPosition:
    """Where a micro-batch lies in the run: what a task seeds its per-batch randomness from, so that a resumed
    run draws what the uninterrupted one drew."""

    seed: int
    rank: int
    epoch: int
    batch: int            # micro-batch index within the epoch

    def rng(self) -> random.Random:
        return random.Random(f"{self.seed}-{self.rank}-{self.epoch}-{self.batch}")


# A value to log: a number, a 0-d tensor (read only on the steps that log: reading a GPU tensor waits for the
# device, which a step that logs nothing must not), or a callable computing it (called only on those steps).
Scalar = float | torch.Tensor | Callable[[], float]


def scalar_value(value: Scalar) -> float:
    """The number a logged step writes for `value`."""
    return float(value() if callable(value) else value)


@dataclass
class BatchLoss:
    """The loss of one micro-batch (a scalar the loop backpropagates), the values to log (averaged over the
    step's micro-batches and the processes, on the steps that log: see `Scalar`), and, optionally, images to
    show: a callable returning {tag: (rows, cols, C, H, W) in [0, 1]}, called only on steps that log images."""

    loss: torch.Tensor
    scalars: dict[str, Scalar] = field(default_factory=dict)
    images: Callable[[], dict[str, torch.Tensor]] | None = None


class TrainingTask(nn.Module):
    """Defaults for the optional parts of the interface; a task defines `batch_loss` (and `forward`, which the
    engine calls)."""

    def batch_loss(self, engine, batch: Any, position: BatchPosition,
                   autocast: Callable[[], AbstractContextManager]) -> BatchLoss:
        raise NotImplementedError

    def param_groups(self) -> list[dict]:
        return [{"params": [p for p in self.parameters() if p.requires_grad]}]

    def after_step(self, step: int) -> None:
        pass

    def after_epoch(self, engine, epoch: int, step: int) -> dict[str, float]:
        return {}

    def scalars(self) -> dict[str, float]:
        return {}

    def state_outside_engine(self) -> dict:
        return {}

    def load_state_outside_engine(self, state: dict) -> None:
        pass

    def write_export(self, run_dir: Path, epoch: int, step: int) -> None:
        pass
