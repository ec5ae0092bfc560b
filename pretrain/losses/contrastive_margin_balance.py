"""The contrastive margin loss split into a positive and an entropy sub-loss, with balance weights.

Sors, Sampaio de Rezende, Ibrahimi & Andreoli, "Simple and Effective Balance of Contrastive Losses"
(paper 000), eqs. 1-2 (q = 1), 5 and 7, and the two usual batch aggregations of section 4.1:

    l_p(z_i, z_j) = d(z_i, z_j)                       for a positive pair (y_i = y_j, i != j)      (2)
    l_e(z_i, z_j) = max(0, m - d(z_i, z_j))           for a negative pair (y_i != y_j)             (2)
    L = lambda_p * mean_{(i,j) in P} l_p + lambda_e * mean_{(i,j) in E} l_e                      (5, 7)

with d the Euclidean distance between L2-normalised embeddings (d in [0, 2]; the paper's DML margin is
m = 0.5). `averaging` picks the aggregation:

- "separate": L as written, the means over P and over E taken separately (section 4.1: the separate
  average is lambda_p = lambda_e = 1); lambda_p, lambda_e other than 1 give the tuned balance of eq. 5.
- "global": one mean over all pairs, sum_P l_p + sum_E l_e over |P| + |E|, each sum times its lambda. With
  lambda_p = lambda_e = 1 it is eq. 5 with lambda_p = |P| / (|P| + |E|) and lambda_e = |E| / (|P| + |E|),
  which for a 2-per-class batch of b (|P| = b, |E| = b^2 - 2b) is the paper's lambda_p = 1 / (b - 1),
  lambda_e = 1 - 1 / (b - 1): the relative weight of the two sub-losses then moves with the batch size.

The pairs are those of the batch I of SupCon's `contrast_set` (pretrain/losses/supcon.py): every view of
every image, positives sharing the label (or, without labels, the image), never a view with itself. With
negatives gathered across processes, each process averages over the pairs of its own anchors.

The per-sample values returned have the batch loss L as their mean (each image carries its anchors' share
of the two sums), so that hard view selection can score samples with them.
"""
from __future__ import annotations

import torch

from pretrain.losses.supcon import ContrastSet, contrast_set

AVERAGING = ("separate", "global")
# Below this squared distance the Euclidean distance is clamped: sqrt has an infinite slope at 0, and two
# views can embed to the same point.
MIN_SQUARED_DISTANCE = 1e-12


def global_average_lambdas(num_positive_pairs: int, num_negative_pairs: int) -> tuple[float, float]:
    """(lambda_p, lambda_e) that make eq. 5 the global average over all pairs (section 4.1)."""
    total = num_positive_pairs + num_negative_pairs
    return num_positive_pairs / total, num_negative_pairs / total


def euclidean_distances(contrast: ContrastSet) -> torch.Tensor:
    """(A, M) ||z_i - z_a|| of unit vectors, sqrt(2 - 2 z_i.z_a), clamped at MIN_SQUARED_DISTANCE."""
    return (2 - 2 * contrast.dots).clamp(min=MIN_SQUARED_DISTANCE).sqrt()


def margin_balance_per_sample(z: torch.Tensor, labels: torch.Tensor | None, margin: float = 0.5,
                              lambda_p: float = 1.0, lambda_e: float = 1.0, averaging: str = "separate",
                              gather_negatives: bool = False
                              ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Per-sample balanced contrastive margin loss and its two sub-losses.

    Args:
        z: (B, k, D) L2-normalised embeddings, k >= 1 views per image (k = 1 needs labels).
        labels: (B,) class labels >= 0, or None (positives are then only the other views of an image).
        margin: m > 0 of eq. 2, in units of the Euclidean distance of unit vectors (0 < m <= 2).
        lambda_p, lambda_e: the balance weights of eq. 5 (>= 0).
        averaging: "separate" (means over P and E, eq. 7) or "global" (one mean over all pairs); see the
            module docstring.
        gather_negatives: contrast with the views of every process (see `contrast_set`).

    Returns:
        per_sample: (B,) losses whose mean is L of eq. 5.
        (positive, entropy): 0-dim, the sub-losses mean_P l_p and mean_E l_e (no gradient), the two axes of
            the paper's Figure 4.

    Example:
        >>> per_sample, (l_p, l_e) = margin_balance_per_sample(F.normalize(z, dim=-1), labels, margin=0.5)
        >>> loss = per_sample.mean()
    """
    if not margin > 0:
        raise ValueError(f"margin={margin} must be positive (the paper uses 0.5 on unit vectors)")
    if min(lambda_p, lambda_e) < 0:
        raise ValueError(f"lambda_p={lambda_p} and lambda_e={lambda_e} must be >= 0 (1 and 1: separate averages)")
    if averaging not in AVERAGING:
        raise ValueError(f"averaging={averaging!r} is not one of {AVERAGING}")
    contrast = contrast_set(z, labels, gather_negatives)
    distance = euclidean_distances(contrast)
    positive_terms = torch.where(contrast.positives, distance, torch.zeros_like(distance))           # l_p
    entropy_terms = torch.where(contrast.negatives, (margin - distance).clamp(min=0), torch.zeros_like(distance))
    num_positive = int(contrast.positives.sum())
    num_negative = int(contrast.negatives.sum())
    if averaging == "global":
        pairs = max(num_positive + num_negative, 1)
        scale_p, scale_e = lambda_p / pairs, lambda_e / pairs
    else:
        scale_p, scale_e = lambda_p / max(num_positive, 1), lambda_e / max(num_negative, 1)
    anchors = distance.shape[0]
    per_anchor = anchors * (scale_p * positive_terms.sum(dim=1) + scale_e * entropy_terms.sum(dim=1))
    with torch.no_grad():
        positive = positive_terms.sum() / max(num_positive, 1)
        entropy = entropy_terms.sum() / max(num_negative, 1)
    return contrast.per_sample(per_anchor), (positive, entropy)
