"""What the two-view methods (SimCLR, SimSiam) share: the candidate pairs and the view-stack forward."""
from __future__ import annotations

from itertools import combinations

import torch
from torch import nn


def all_pairs(num_views: int) -> list[tuple[int, int]]:
    """The N(N-1)/2 unordered view pairs that hard view selection scores (HVS eq. 2)."""
    return list(combinations(range(num_views), 2))


def encode_view_stack(encoder: nn.Module, views: torch.Tensor) -> torch.Tensor:
    """(B, n, C, H, W) -> (B, n, D): one forward of all B * n views."""
    batch, count = views.shape[:2]
    return encoder(views.flatten(0, 1)).unflatten(0, (batch, count))


def split_decay_groups(module: nn.Module, **flags) -> list[dict]:
    """Weights in one group; biases and normalisation parameters (1-D) in a `no_decay` group."""
    decay = [p for p in module.parameters() if p.ndim > 1]
    no_decay = [p for p in module.parameters() if p.ndim <= 1]
    return [{"params": decay, **flags}, {"params": no_decay, "no_decay": True, **flags}]
