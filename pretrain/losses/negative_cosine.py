"""The symmetric negative-cosine loss of SimSiam with stop-gradient.

Chen & He, "Exploring Simple Siamese Representation Learning", CVPR 2021, eqs. 1-4; HVS (Ferreira et al.)
eq. 1 in per-sample form:

    L = D(p_1, stopgrad(z_2)) / 2 + D(p_2, stopgrad(z_1)) / 2,   D(p, z) = -cos(p, z)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def negative_cosine_per_sample(p_a: torch.Tensor, z_a: torch.Tensor,
                               p_b: torch.Tensor, z_b: torch.Tensor) -> torch.Tensor:
    """Per-sample symmetric SimSiam loss, in [-1, 1].

    Args:
        p_a, p_b: (B, D) predictor outputs of the two views.
        z_a, z_b: (B, D) projector outputs of the two views; no gradient flows into them (stop-gradient).

    Returns:
        (B,) loss of every sample.

    Example:
        >>> loss = negative_cosine_per_sample(p1, z1, p2, z2).mean()
    """
    if not (p_a.shape == z_a.shape == p_b.shape == z_b.shape):
        raise ValueError("p_a, z_a, p_b, z_b must share one (B, D) shape; got "
                         f"{[tuple(t.shape) for t in (p_a, z_a, p_b, z_b)]}")
    d_ab = -F.cosine_similarity(p_a, z_b.detach(), dim=1)
    d_ba = -F.cosine_similarity(p_b, z_a.detach(), dim=1)
    return 0.5 * (d_ab + d_ba)
