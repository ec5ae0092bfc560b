"""Optimizers (SGD, LARS, Adam, AdamW) and the precomputed schedules of learning rate and weight decay.

Schedules are arrays indexed by optimizer step (as in DINO's main_dino.py): any step's value is a lookup,
so resuming at step s continues the schedule exactly, and the schedule is testable on its own.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from omegaconf import DictConfig


class LARS(torch.optim.Optimizer):
    """Layer-wise adaptive rate scaling (You et al., 2017), as used by SimCLR: SGD with momentum where each
    parameter's update is scaled by trust * ||w|| / ||g + wd * w||. Groups flagged `no_decay` (biases,
    normalisation) get neither weight decay nor the layer-wise scaling.
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = p.grad
                if not group.get("no_decay", False):
                    update = update.add(p, alpha=group["weight_decay"])
                    w_norm, u_norm = torch.norm(p), torch.norm(update)
                    trust = torch.where((w_norm > 0) & (u_norm > 0),
                                        group["trust_coefficient"] * w_norm / u_norm, torch.ones_like(w_norm))
                    update = update.mul(trust)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.clone(update).detach()
                else:
                    state["momentum_buffer"].mul_(group["momentum"]).add_(update)
                p.add_(state["momentum_buffer"], alpha=-group["lr"])


def scaled_lr(cfg: DictConfig, global_batch: int) -> float:
    """The peak learning rate: `optim.lr` is given for a global batch of 256."""
    factor = {"linear": global_batch / 256, "sqrt": math.sqrt(global_batch / 256), "none": 1.0}
    return cfg.optim.lr * factor[cfg.optim.lr_scaling]


def build_optimizer(cfg: DictConfig, param_groups: list[dict], peak_lr: float) -> torch.optim.Optimizer:
    """The optimizer over the method's groups; `no_decay` groups get no weight decay, unless
    `optim.decay_norm_and_bias`.

    adam is torch.optim.Adam, whose weight decay is coupled: wd * w is added to the gradient before the moments (an
    L2 penalty, divided by Adam's scaling like the gradient), as paper 002's "Adam optimizer with 5e-4 weight
    decay". adamw decouples it (w <- w - lr * wd * w beside the Adam step, Loshchilov & Hutter 2019): there the
    same 5e-4 at an lr of 1e-4 takes 5e-8 of every weight per step, almost no decay.
    """
    optim = cfg.optim
    for group in param_groups:
        if optim.get("decay_norm_and_bias"):     # every parameter decays: the groups' no_decay flags are dropped
            group.pop("no_decay", None)
        group["weight_decay"] = 0.0 if group.get("no_decay") else optim.weight_decay
    if optim.name == "sgd":
        return torch.optim.SGD(param_groups, lr=peak_lr, momentum=optim.momentum, weight_decay=optim.weight_decay)
    if optim.name == "lars":
        return LARS(param_groups, lr=peak_lr, momentum=optim.momentum, weight_decay=optim.weight_decay)
    if optim.name == "adam":
        return torch.optim.Adam(param_groups, lr=peak_lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay)
    return torch.optim.AdamW(param_groups, lr=peak_lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay)


def cosine_schedule(start: float, end: float, total_steps: int, warmup_steps: int = 0,
                    warmup_start: float = 0.0) -> np.ndarray:
    """Linear warm-up from `warmup_start` to `start`, then half-cosine from `start` to `end`."""
    warmup_steps = min(warmup_steps, total_steps)
    warmup = np.linspace(warmup_start, start, warmup_steps, endpoint=False)
    steps = np.arange(total_steps - warmup_steps)
    cosine = end + 0.5 * (start - end) * (1 + np.cos(np.pi * steps / max(len(steps), 1)))
    return np.concatenate([warmup, cosine])


def step_schedule(start: float, total_steps: int, milestones: Sequence[float], factor: float, warmup_steps: int = 0,
                  warmup_start: float = 0.0) -> np.ndarray:
    """Linear warm-up from `warmup_start` to `start`, then `start` multiplied by `factor` at every milestone passed:
    the value at step s is start * factor ** #{m in milestones : s >= round(m * total_steps)}, the milestones
    given as fractions of training (paper 002: [0.5, 0.8] with factor 0.1, "reduce the learning rate by 10 at 50%
    and 80% of total iterations")."""
    warmup_steps = min(warmup_steps, total_steps)
    warmup = np.linspace(warmup_start, start, warmup_steps, endpoint=False)
    steps = np.arange(warmup_steps, total_steps)
    boundaries = np.array([round(m * total_steps) for m in milestones])
    passed = (steps[:, None] >= boundaries[None, :]).sum(axis=1)
    return np.concatenate([warmup, start * factor ** passed])


def set_schedule_values(optimizer: torch.optim.Optimizer, lr: float, weight_decay: float, base_lr: float,
                        step: int = 0) -> None:
    """Apply one step's values. Groups flagged `fixed_lr` stay at the base lr (SimSiam's predictor); groups
    with `frozen_steps` get lr 0 before that step (DINO's last layer in its first epoch: their gradients are
    cancelled too, `pretrain/runtime/gradient_edits.py`); a group's `lr_scale` multiplies its lr (layer-wise lr decay
    in fine-tuning)."""
    for group in optimizer.param_groups:
        group["lr"] = (base_lr if group.get("fixed_lr") else lr) * group.get("lr_scale", 1.0)
        if step < group.get("frozen_steps", 0):
            group["lr"] = 0.0
        if not group.get("no_decay"):
            group["weight_decay"] = weight_decay


@dataclass(frozen=True)
class Schedules:
    """The peak learning rate and the per-step learning rate and weight decay (arrays indexed by optimizer step)."""

    peak_lr: float
    lr: np.ndarray
    weight_decay: np.ndarray


def schedules_from_config(cfg: DictConfig, steps_per_epoch: int, schedule_steps: int, global_batch: int) -> Schedules:
    """The `optim.*` recipe of pretraining, fine-tuning and detection over `schedule_steps` optimizer steps (the run's
    length, decided once by the loop: optim.epochs x steps_per_epoch, or what a compute budget buys,
    `pretrain.runtime.compute_budget.schedule_length`): the lr scaled to the global batch
    (`scaled_lr`), a linear warm-up over optim.warmup_epochs (from 0, or from optim.warmup_start_factor x the peak
    where the schema has that key: detection's) then, with optim.lr_schedule=cosine (the default), a cosine to
    optim.min_lr, or with lr_schedule=step, steps down by optim.lr_step_factor at the optim.lr_milestones
    (`step_schedule`); the weight decay a cosine from optim.weight_decay to optim.weight_decay_end (constant when
    that is null)."""
    optim = cfg.optim
    peak_lr = scaled_lr(cfg, global_batch)
    warmup_steps = int(optim.warmup_epochs * steps_per_epoch)
    warmup_start = optim.get("warmup_start_factor", 0.0) * peak_lr
    if optim.lr_schedule == "step":
        lr = step_schedule(peak_lr, schedule_steps, list(optim.lr_milestones), optim.lr_step_factor, warmup_steps,
                           warmup_start)
    else:
        lr = cosine_schedule(peak_lr, optim.min_lr, schedule_steps, warmup_steps, warmup_start)
    wd_end = optim.weight_decay if optim.weight_decay_end is None else optim.weight_decay_end
    return Schedules(peak_lr=peak_lr, lr=lr, weight_decay=cosine_schedule(optim.weight_decay, wd_end, schedule_steps))


def divergence_advice(cfg: DictConfig) -> str:
    """What to try when a run of the `optim.*` recipe diverged."""
    optim = cfg.optim
    return (f"Try a lower optim.lr (now {optim.lr}), gradient clipping (optim.grad_clip=1.0, now {optim.grad_clip}) "
            f"or a longer warm-up (optim.warmup_epochs, now {optim.warmup_epochs}).")
