"""`seeded_generator`: the CPU torch.Generator that every loader draws an epoch's order and its augmentations from.

A leaf of `pretrain.data` (it imports nothing of the project), so that the loaders
(`pretrain.data.loader`, `pretrain.data.torchvision_loader`) and the fine-tuning augmentation can all use it
without importing one another.
"""
from __future__ import annotations

import numpy as np
import torch


def seeded_generator(*keys: int) -> torch.Generator:
    """A CPU torch.Generator seeded from a tuple of integers (mixed with numpy's SeedSequence)."""
    state = np.random.SeedSequence([int(k) for k in keys]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state) >> 1)
