"""Pretraining methods. Each is an `nn.Module` with one small protocol (shared/DESIGN.md), which is all
that hard view selection and the training loop need:

    forward(views (B, n, C, H, W)) -> outputs       one forward of a stack of views; a dict of (B, n, ...)
    candidates(num_views) -> [combination, ...]     the view combinations worth scoring (pairs, ...)
    sample_loss(outputs, combination) -> (B,)       per-sample loss of one combination (selection pass)
    loss(outputs) -> scalar                         training loss on the chosen views
    param_groups() -> [dict, ...]                   optimizer groups (flags: no_decay, fixed_lr)
    after_step(step)                                EMA / queue / centre updates where a method has them

Adding a method: one file here, registered in METHODS, one loss in pretrain/losses/, one config.
"""
from __future__ import annotations

from omegaconf import DictConfig
from torch import nn

from pretrain.methods.simclr import SimCLR
from pretrain.methods.simsiam import SimSiam

METHODS = {"simclr": SimCLR, "simsiam": SimSiam}


def build_method(cfg: DictConfig) -> nn.Module:
    return METHODS[cfg.method.name](cfg)
