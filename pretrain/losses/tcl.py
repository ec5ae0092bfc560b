"""TCL, the Tuned Contrastive Learning loss, with k >= 2 views per image, with or without labels.

Animesh & Chandraker, "Tuned Contrastive Learning", eqs. 9-11, with the gradient of Lemma 2 (eqs. 12-16):

    L_i = -1/|P(i)| sum_{p in P(i)} log( exp(z_i.z_p / t) / D(z_i) )                                   (9)
    D(z_i) = sum_{p' in P(i)} exp(z_i.z_p' / t) + k1 sum_{p' in P(i)} exp(-z_i.z_p')                    (10)
             + k2 sum_{n in N(i)} exp(z_i.z_n / t),          k1, k2 >= 1                                (11)

P(i), N(i) and the batch I are SupCon's (pretrain/losses/supcon.py, `contrast_set`): the other views of the
anchor's image, plus with labels every view of the same class; negatives are all other views. Note that the
k1 term has no temperature, exactly as in eq. 10. With k1 = 0 and k2 = 1, D is SupCon's eq. 3. As for SupCon,
training uses the mean of L_i over anchors (eq. 8 sums them: the mean only rescales the learning rate).

log D is computed as one logsumexp over the three sums with log k1 and log k2 added to their exponents, so
k1 = 5000 or 50000 and small temperatures neither overflow nor lose the other terms.
"""
from __future__ import annotations

import math

import torch

from pretrain.losses.supcon import ContrastSet, contrast_set


def check_tcl_parameters(temperature: float, k1: float, k2: float) -> None:
    """Raise ValueError unless t > 0 and k1, k2 >= 1 (eq. 11; Theorems 1 and 2 assume it)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be positive (TCL uses 0.1)")
    for name, value in (("k1", k1), ("k2", k2)):
        if not value >= 1:
            raise ValueError(f"{name}={value} is not allowed: TCL needs k1 >= 1 and k2 >= 1 (eq. 11, the condition "
                             f"of Theorems 1 and 2); for the SupCon loss use pretrain.losses.supcon")


def tcl_per_sample(z: torch.Tensor, labels: torch.Tensor | None, temperature: float, k1: float, k2: float,
                   gather_negatives: bool = False) -> torch.Tensor:
    """Per-sample TCL loss (eqs. 9-11): the mean of L_i over the k anchors of each image.

    Args:
        z: (B, k, D) L2-normalised embeddings of k >= 2 views of each image (the paper's self-supervised
            setting uses k = 3, positive triplets).
        labels: (B,) class labels (supervised TCL), or None (self-supervised: only the other views of the same
            image are positives).
        temperature: t > 0 (the paper uses 0.1).
        k1: weight >= 1 of the positives' exp(-z_i.z_p') term, which raises the gradient from hard positives
            (Theorem 1; the paper's sec. 4.4 uses 5000-50000).
        k2: weight >= 1 of the negatives' term, which raises the gradient from hard negatives (Theorem 2).
        gather_negatives: contrast with the views of every process (see `contrast_set`).

    Returns:
        (B,) losses; their mean is the mean of L_i over all anchors.

    Example:
        >>> z = F.normalize(projector(backbone(views.flatten(0, 1))), dim=-1).unflatten(0, (B, 3))
        >>> loss = tcl_per_sample(z, None, temperature=0.1, k1=5000.0, k2=1.0).mean()
    """
    check_tcl_parameters(temperature, k1, k2)
    contrast = contrast_set(z, labels, gather_negatives)
    return contrast.per_sample(_tcl_per_anchor(contrast, temperature, k1, k2))


def _tcl_log_denominator(contrast: ContrastSet, temperature: float, k1: float, k2: float) -> torch.Tensor:
    """(A,) log D(z_i) of eqs. 10-11, unchecked (k1 = 0 or k2 = 0 drop their term)."""
    logits = contrast.dots / temperature
    minus_inf = float("-inf")
    terms = [logits.masked_fill(~contrast.positives, minus_inf)]
    if k1 > 0:
        terms.append((math.log(k1) - contrast.dots).masked_fill(~contrast.positives, minus_inf))  # no 1/t: eq. 10
    if k2 > 0:
        terms.append((math.log(k2) + logits).masked_fill(~contrast.negatives, minus_inf))
    return torch.logsumexp(torch.cat(terms, dim=1), dim=1)


def _tcl_per_anchor(contrast: ContrastSet, temperature: float, k1: float, k2: float) -> torch.Tensor:
    """(A,) L_i of eq. 9 for every anchor. Unchecked, for tests: k1 = 0, k2 = 1 is SupCon. Use tcl_per_sample."""
    logits = contrast.dots / temperature
    # -1/|P| sum_p (z_i.z_p / t - log D) = log D - mean_p z_i.z_p / t
    return _tcl_log_denominator(contrast, temperature, k1, k2) - contrast.mean_over(logits, contrast.positives)


@torch.no_grad()
def tcl_gradient_means(z: torch.Tensor, labels: torch.Tensor | None, temperature: float, k1: float, k2: float,
                       gather_negatives: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The Figure-3 quantities of the paper (sec. 4.4), from the terms of Lemma 2 (eqs. 12-16).

    grad_pos: per anchor the mean over its positives of |X_ip - P^t_ip + Y^t_ip| (the left side of eq. 17, TCL's
        hard-positive gradient coefficient), averaged over anchors.
    grad_neg: per anchor the mean over its negatives of P^t_in (eq. 16), averaged over anchors (those with
        negatives).
    As in eq. 17 the common factor 1/t of eq. 12 is left out. Arguments as in `tcl_per_sample`; the SupCon
    values (Lemma 1) are `pretrain.losses.supcon.supcon_gradient_means`, and Theorem 1 says grad_pos is larger
    here on the same embeddings.

    Example:
        >>> grad_pos, grad_neg = tcl_gradient_means(z, None, temperature=0.1, k1=5000.0, k2=1.0)
    """
    check_tcl_parameters(temperature, k1, k2)
    return _tcl_gradient_means(contrast_set(z, labels, gather_negatives), temperature, k1, k2)


def tcl_loss_and_gradient_means(z: torch.Tensor, labels: torch.Tensor | None, temperature: float, k1: float,
                                k2: float, gather_negatives: bool = False
                                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """`tcl_per_sample` and `tcl_gradient_means` of the same inputs from one contrast set (one gather, one
    similarity matrix): what a training step that logs the Figure-3 values needs."""
    check_tcl_parameters(temperature, k1, k2)
    contrast = contrast_set(z, labels, gather_negatives)
    return (contrast.per_sample(_tcl_per_anchor(contrast, temperature, k1, k2)),
            _tcl_gradient_means(contrast, temperature, k1, k2))


@torch.no_grad()
def _tcl_gradient_means(contrast: ContrastSet, temperature: float, k1: float,
                        k2: float) -> tuple[torch.Tensor, torch.Tensor]:
    log_d = _tcl_log_denominator(contrast, temperature, k1, k2)[:, None]
    p = torch.exp(contrast.dots / temperature - log_d)                            # P^t_ia, eq. 14
    y = temperature * k1 * torch.exp(-contrast.dots - log_d)                     # Y^t_ip, eq. 15
    x = 1.0 / contrast.positives.sum(dim=1, keepdim=True).to(contrast.dots.dtype)      # X_ip, eq. 13
    return contrast.figure3_means((x - p + y).abs(), k2 * p)                      # P^t_in = k2 P^t_ia, eq. 16
