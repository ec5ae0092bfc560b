"""InfoNCE split into a positive and an entropy sub-loss, with balance weights.

Sors, Sampaio de Rezende, Ibrahimi & Andreoli, "Simple and Effective Balance of Contrastive Losses"
(paper 000), eqs. 3-5 and 8, with the cosine distance d(z_i, z_j) = 1 - z_i.z_j of unit vectors:

    l_p(z_i, z_j)          = d(z_i, z_j) / t                                                      (4)
    l_e(z_i, (z_k)_{K_ij}) = log sum_{k in K_ij} exp(-d(z_i, z_k) / t),  K_ij = {j} u N(i)          (4)
    L = lambda_p * mean_{(i,j) in P} l_p + lambda_e * mean_{(i,j) in P} l_e                       (5, 8)

Both means run over the positive pairs P (section 4.2); lambda_p = lambda_e = 1 is the usual InfoNCE,
-log(exp(-d_ij / t) / sum_{K_ij} exp(-d_ik / t)), averaged over the positive pairs: the constant 1/t in
l_p and the -1/t inside l_e cancel. For InfoNCE the global / separate question of the margin loss does
not arise (section 4); only the ratio lambda_e / lambda_p moves the balance. With several positives per
anchor, each positive pair has its own K_ij: the anchor's negatives and that one positive, not the others.

P(i) and N(i) are SupCon's `contrast_set` (pretrain/losses/supcon.py). The per-sample values returned have
the batch loss L as their mean.
"""
from __future__ import annotations

import torch

from pretrain.losses.supcon import contrast_set


def infonce_balance_per_sample(z: torch.Tensor, labels: torch.Tensor | None, temperature: float = 0.1,
                               lambda_p: float = 1.0, lambda_e: float = 1.0, gather_negatives: bool = False
                               ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Per-sample balanced InfoNCE loss and its two sub-losses.

    Args:
        z: (B, k, D) L2-normalised embeddings, k >= 1 views per image (k = 1 needs labels).
        labels: (B,) class labels >= 0, or None (positives are then only the other views of an image).
        temperature: t > 0 (the paper: 0.1).
        lambda_p, lambda_e: the balance weights of eq. 5 (>= 0; 1 and 1 is the usual InfoNCE).
        gather_negatives: contrast with the views of every process (see `contrast_set`).

    Returns:
        per_sample: (B,) losses whose mean is L of eq. 5.
        (positive, entropy): 0-dim, mean_P l_p and mean_P l_e (no gradient).

    Example:
        >>> per_sample, (l_p, l_e) = infonce_balance_per_sample(F.normalize(z, dim=-1), labels, 0.1, 1.0, 2.0)
    """
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be positive (the paper uses 0.1)")
    if min(lambda_p, lambda_e) < 0:
        raise ValueError(f"lambda_p={lambda_p} and lambda_e={lambda_e} must be >= 0 (1 and 1: the usual InfoNCE)")
    contrast = contrast_set(z, labels, gather_negatives)
    neg_distance = (contrast.dots - 1) / temperature                              # -d / t
    negatives_lse = torch.logsumexp(neg_distance.masked_fill(~contrast.negatives, float("-inf")), dim=1)
    positive_terms = -neg_distance                                                # l_p, eq. 4
    entropy_terms = torch.logaddexp(neg_distance, negatives_lse[:, None])         # l_e over K_ij = {j} u N(i)
    zeros = torch.zeros_like(positive_terms)
    positive_terms = torch.where(contrast.positives, positive_terms, zeros)
    entropy_terms = torch.where(contrast.positives, entropy_terms, zeros)
    num_positive = max(int(contrast.positives.sum()), 1)
    anchors = positive_terms.shape[0]
    per_anchor = anchors / num_positive * (lambda_p * positive_terms.sum(dim=1) + lambda_e * entropy_terms.sum(dim=1))
    with torch.no_grad():
        positive, entropy = positive_terms.sum() / num_positive, entropy_terms.sum() / num_positive
    return contrast.per_sample(per_anchor), (positive, entropy)
