"""The weighted contrastive loss, the balanced contrastive loss, and its mini-batch form with importance
weights for the p-random and (m, n)-group batch designs.

Hong, Park & Kim, "Deep Metric Learning via Weighted Contrastive Loss" (paper 001), sections 3-5:

    g(D) = D^2,  h(D) = max(0, alpha - D)^2,  D_ij = ||f_i - f_j||                                   (5)
    L = sum_{(i,j) in P} [ Y_ij g(D_ij) + (1 - Y_ij) eta_ij h(D_ij) ]                              (10)
        P: every ordered pair of distinct examples, Y_ij = 1{y_i = y_j}
    eta_ij = 1                                                     the contrastive loss (4)
    eta_ij = lambda / (L - 1) * (N_{y_i} - 1) / N_{y_j}            the balanced contrastive loss (15)
    mini-batch: 1/B sum_k W_{i_k j_k} [ Y g(D) + (1 - Y) eta h(D) ] over the B pairs of the batch   (23)
    W_ij = P_U(i, j) / Q(i, j),  P_U = 1 / (N (N - 1))   with Q of the batch design:                 (21)
      p-random     W = L N_yi (N_yi - 1) / (p N (N - 1))             if y_i = y_j                    (24)
                   W = L (L - 1) N_yi N_yj / ((1 - p) N (N - 1))     otherwise
      (m,n)-group  W = L (mn - 1) N_yi (N_yi - 1) / ((m - 1) N (N - 1))          if y_i = y_j        (25)
                   W = L (L - 1) (mn - 1) N_yi N_yj / (m (n - 1) N (N - 1))      otherwise
      uniform      W = 1 (a uniformly random subset of distinct images: Q = P_U)

N_c is the number of training images of class c, N = sum_c N_c, L the number of classes. Eq. 16 prints the
last denominator of eta as N_{y_i}; eq. 15 and the summary after eq. 25 have N_{y_j}, which is what the
derivation (eqs. 13-14: lambda negatives per positive pair, one class drawn uniformly) gives: N_{y_j}.
The paper's lambda is 128-512 for datasets of about 100 training classes; eq. 17 gives the lambda that
reproduces the plain contrastive loss, N_yj (L - 1) / (N_yi - 1), about L - 1 for balanced classes.

Distances are between the embeddings as given; the method L2-normalises them first (alpha then lies in
(0, 2]). The batch designs themselves are samplers of the loader (pretrain/data/batch_designs.py).
"""
from __future__ import annotations

import torch

ETAS = ("contrastive", "balanced")


def pair_terms(anchors: torch.Tensor, candidates: torch.Tensor, same_class: torch.Tensor, eta: torch.Tensor,
               margin: float) -> torch.Tensor:
    """(A, M) the bracket of eq. 10 for every (anchor, candidate) pair: Y g(D) + (1 - Y) eta h(D).

    anchors: (A, D), candidates: (M, D) embeddings; same_class: (A, M) bool Y; eta: (A, M) negative weights
    (ignored where Y); margin: alpha > 0 of h.
    """
    if not margin > 0:
        raise ValueError(f"margin={margin} must be positive (alpha of h(D) = max(0, alpha - D)^2)")
    # D^2 from the dot products, without a sqrt: its slope is infinite at D = 0 (a pair of equal embeddings,
    # or an anchor with itself where the pair mask later drops it, would turn the gradient into NaN).
    squared = (anchors.square().sum(1)[:, None] + candidates.square().sum(1)[None, :]
               - 2 * anchors @ candidates.T).clamp(min=0)
    distance = squared.clamp(min=1e-12).sqrt()
    negative = eta * (margin - distance).clamp(min=0).square()
    return torch.where(same_class, squared, negative)


def contrastive_eta(anchor_labels: torch.Tensor, candidate_labels: torch.Tensor) -> torch.Tensor:
    """(A, M) eta_ij = 1: the contrastive loss of eq. 4 as a weighted contrastive loss."""
    return torch.ones(len(anchor_labels), len(candidate_labels), device=anchor_labels.device)


def balanced_eta(anchor_labels: torch.Tensor, candidate_labels: torch.Tensor, class_counts: torch.Tensor,
                 balance_lambda: float) -> torch.Tensor:
    """(A, M) eta_ij = lambda / (L - 1) * (N_yi - 1) / N_yj of eq. 15 (see the module docstring on eq. 16).

    class_counts: (C,) N_c of every class label 0 .. C-1 in the training set (classes with N_c = 0 do not
    count in L).
    """
    if not balance_lambda > 0:
        raise ValueError(f"balance_lambda={balance_lambda} must be positive (the paper: 128-512 with ~100 classes)")
    counts = class_counts.to(anchor_labels.device, torch.float64)
    classes = int((counts > 0).sum())
    if classes < 2:
        raise ValueError(f"the balanced contrastive loss needs at least 2 classes with images; class_counts has "
                         f"{classes}")
    n_i = counts[anchor_labels][:, None]
    n_j = counts[candidate_labels][None, :]
    return (balance_lambda / (classes - 1) * (n_i - 1) / n_j).float()


def p_random_importance_weights(anchor_labels: torch.Tensor, candidate_labels: torch.Tensor,
                                class_counts: torch.Tensor, positive_fraction: float) -> torch.Tensor:
    """(A, M) W_ij of eq. 24 for the p-random design (p = positive_fraction in (0, 1))."""
    if not 0 < positive_fraction < 1:
        raise ValueError(f"positive_fraction={positive_fraction} must lie in (0, 1): eq. 24 divides by p and 1 - p")
    n_i, n_j, classes, total = _class_sizes(anchor_labels, candidate_labels, class_counts)
    scale = total * (total - 1)
    positive = classes * n_i * (n_i - 1) / (positive_fraction * scale)
    negative = classes * (classes - 1) * n_i * n_j / ((1 - positive_fraction) * scale)
    return torch.where(anchor_labels[:, None] == candidate_labels[None, :], positive, negative).float()


def group_importance_weights(anchor_labels: torch.Tensor, candidate_labels: torch.Tensor, class_counts: torch.Tensor,
                             images_per_class: int, classes_per_batch: int) -> torch.Tensor:
    """(A, M) W_ij of eq. 25 for the (m, n)-group design (m = images_per_class >= 2, n = classes_per_batch
    >= 2)."""
    m, n = images_per_class, classes_per_batch
    if m < 2 or n < 2:
        raise ValueError(f"the (m, n)-group design needs m >= 2 and n >= 2 (eq. 25 divides by m - 1 and n - 1); got "
                         f"m={m}, n={n}")
    n_i, n_j, classes, total = _class_sizes(anchor_labels, candidate_labels, class_counts)
    scale = total * (total - 1)
    positive = classes * (m * n - 1) * n_i * (n_i - 1) / ((m - 1) * scale)
    negative = classes * (classes - 1) * (m * n - 1) * n_i * n_j / (m * (n - 1) * scale)
    return torch.where(anchor_labels[:, None] == candidate_labels[None, :], positive, negative).float()


def _class_sizes(anchor_labels: torch.Tensor, candidate_labels: torch.Tensor, class_counts: torch.Tensor):
    """N_yi (A, 1), N_yj (1, M) in float64, L and N."""
    counts = class_counts.to(anchor_labels.device, torch.float64)
    return (counts[anchor_labels][:, None], counts[candidate_labels][None, :], int((counts > 0).sum()),
            float(counts.sum()))


def weighted_contrastive_sum(embeddings: torch.Tensor, labels: torch.Tensor, eta: torch.Tensor,
                             margin: float) -> torch.Tensor:
    """Eq. 10 over a whole (small) set: the sum over every ordered pair of distinct examples.

    embeddings: (N, D); labels: (N,); eta: (N, N) negative weights (e.g. `balanced_eta(labels, labels, ...)`).
    """
    terms = pair_terms(embeddings, embeddings, labels[:, None] == labels[None, :], eta, margin)
    distinct = ~torch.eye(len(labels), dtype=torch.bool, device=embeddings.device)
    return terms[distinct].sum()


def minibatch_loss_per_anchor(terms: torch.Tensor, pairs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Eq. 23 as (A,) per-anchor shares whose mean is (1/B) sum_k W_k term_k over the B = pairs.sum() pairs.

    terms: (A, M) `pair_terms`; pairs: (A, M) bool, the ordered pairs the batch design put in the mini-batch
    (row: its first element); weights: (A, M) importance weights W (ones: no importance sampling).
    """
    if terms.shape != pairs.shape or terms.shape != weights.shape:
        raise ValueError(f"terms, pairs and weights must have one shape; got {tuple(terms.shape)}, "
                         f"{tuple(pairs.shape)}, {tuple(weights.shape)}")
    count = max(int(pairs.sum()), 1)
    weighted = torch.where(pairs, weights * terms, torch.zeros_like(terms))
    return weighted.sum(dim=1) * (terms.shape[0] / count)
