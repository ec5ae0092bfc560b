"""Pair-weighted contrastive loss of s-MoCo: the weight-assignment forms of Table 1 and the hinge-like
weighting HLL, for a batch of anchors contrasted with a (memory) set of labelled embeddings.

Zhang, Wang, Huang & Scott, "Rethinking Deep Contrastive Learning with Embedding Memory" (paper 002).
General pair weighting (sec. 2.2): with S_ij the cosine similarity of anchor i and candidate j, P_i / N_i
the candidates of i's class / of other classes,

    L = 1/m sum_i L_i,   dL_i / dS_ij = w_ij for j in N_i  and  -w_ij for j in P_i                 (GPW)

so a loss is its pair weights. Each part below is the loss whose gradient is the weight of Table 1
(lambda: `threshold`, alpha / beta: positive / negative scale, tau: `temperature`):

  positives                                               weight (Table 1, sec. 3.3)
    contrastive  sum_P (1 - S)                            1
    binomial     sum_P softplus(alpha (lambda - S)) / alpha   e^{alpha(lambda-S)} / (1 + e^{alpha(lambda-S)})
    ms           log(1 + sum_P e^{alpha(lambda - S)}) / alpha
                                                          e^{alpha(lambda-S_ij)} / (1 + sum_P e^{alpha(lambda-S_ik)})
    infonce      sum_{p in P} -log(e^{S_ip/tau} / (e^{S_ip/tau} + sum_N e^{S_in/tau}))   (1 - softmax_p) / tau
  negatives
    hll          sum_N Phi(S), Phi' = 0 below a, (S - a) / (b - a) between, 1 above b     (HLL, sec. 3.3)
                 a = b: Phi = max(0, S - a), Table 1's contrastive weight 1{S > lambda}
    binomial     sum_N softplus(beta (S - lambda)) / beta     e^{beta(S-lambda)} / (1 + e^{beta(S-lambda)})
    ms           log(1 + sum_N e^{beta(S - lambda)}) / beta
                                                          e^{beta(S_ij-lambda)} / (1 + sum_N e^{beta(S_ik-lambda)})
    infonce      the InfoNCE sum above
                                             sum_{p in P} e^{S_ij/tau} / (e^{S_ip/tau} + sum_N e^{S_in/tau}) / tau

(Table 1 writes InfoNCE's positive weight with the sign of dL/dS; the other rows give its magnitude.) The
two sides combine freely, as in the paper's Table 3: when only one side is InfoNCE, its loss is taken with
the other side's similarities detached, so that each side's gradient is exactly its own weight; InfoNCE on
both sides is the plain InfoNCE loss. The MS rows are Table 1's weights, without the MS loss's pair mining
by relative similarity (Table 1 leaves it out too). With a = b = margin, HLL is the contrastive loss
sum_P (1 - S) + sum_N max(0, S - margin) of XBM and s-MoCo (sec. 3.3: "a contrastive loss with a margin of
0.5 by setting a = b = 0.5").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

POSITIVE_WEIGHTINGS = ("contrastive", "binomial", "ms", "infonce")
NEGATIVE_WEIGHTINGS = ("hll", "binomial", "ms", "infonce")


@dataclass
class PairWeighting:
    """Which Table 1 weight each side gets, and the constants of the forms."""

    positive: str = "contrastive"
    negative: str = "hll"
    hll_a: float = 0.5              # HLL: negatives below similarity a get weight 0
    hll_b: float = 0.5              # HLL: negatives above similarity b get weight 1 (a <= b; linear in between)
    threshold: float = 0.5          # lambda of the binomial and MS forms
    alpha: float = 2.0              # positive scale (binomial, MS)
    beta: float = 50.0              # negative scale (binomial, MS)
    temperature: float = 0.1        # tau of InfoNCE

    def check(self) -> None:
        """Raise ValueError naming a bad setting."""
        if self.positive not in POSITIVE_WEIGHTINGS:
            raise ValueError(f"positive weighting {self.positive!r} is not one of {POSITIVE_WEIGHTINGS}")
        if self.negative not in NEGATIVE_WEIGHTINGS:
            raise ValueError(f"negative weighting {self.negative!r} is not one of {NEGATIVE_WEIGHTINGS}")
        if not -1 <= self.hll_a <= self.hll_b <= 1:
            raise ValueError(f"HLL needs -1 <= a <= b <= 1 (similarities); got a={self.hll_a}, b={self.hll_b}")
        if min(self.alpha, self.beta, self.temperature) <= 0:
            raise ValueError(f"alpha={self.alpha}, beta={self.beta} and temperature={self.temperature} must be "
                             "positive")


def hll_integral(similarity: torch.Tensor, a: float, b: float) -> torch.Tensor:
    """Phi(S) with Phi(-inf..a) = 0 and Phi' the HLL weight: 0 below a, linear from 0 to 1 on [a, b], 1 above b."""
    if b > a:
        return (similarity - a).clamp(0, b - a).square() / (2 * (b - a)) + (similarity - b).clamp(min=0)
    return (similarity - a).clamp(min=0)


def _infonce_terms(positive_logits: torch.Tensor, negative_lse: torch.Tensor) -> torch.Tensor:
    """-log(e^x / (e^x + e^y)) = softplus(y - x) per positive (x: S_ip / tau; y: logsumexp_N S_in / tau)."""
    return F.softplus(negative_lse[:, None] - positive_logits)


def pair_weighting_per_anchor(similarity: torch.Tensor, positives: torch.Tensor, negatives: torch.Tensor,
                              weighting: PairWeighting) -> torch.Tensor:
    """L_i of every anchor (GPW; their mean is the batch loss).

    Args:
        similarity: (A, M) cosine similarities S_ij of the anchors and the candidates (memory entries).
        positives, negatives: (A, M) bool masks P_i and N_i (pairs in neither, such as an anchor with itself,
            count nowhere).
        weighting: the Table 1 forms of both sides (`PairWeighting`).

    Example:
        >>> s = queries @ memory.T
        >>> loss = pair_weighting_per_anchor(s, labels[:, None] == memory_labels, labels[:, None] != memory_labels,
        ...                                  PairWeighting(negative="hll", hll_a=0.5, hll_b=0.5)).mean()
    """
    weighting.check()
    if similarity.shape != positives.shape or similarity.shape != negatives.shape:
        raise ValueError(f"similarity, positives and negatives must have one shape; got {tuple(similarity.shape)}, "
                         f"{tuple(positives.shape)}, {tuple(negatives.shape)}")
    w = weighting
    zeros = torch.zeros_like(similarity)
    infinity = torch.full_like(similarity, float("-inf"))
    tau = w.temperature

    def negatives_lse(s: torch.Tensor) -> torch.Tensor:
        return torch.logsumexp(torch.where(negatives, s / tau, infinity), dim=1)

    if w.positive == "infonce" and w.negative == "infonce":
        terms = _infonce_terms(similarity / tau, negatives_lse(similarity))
        return torch.where(positives, terms, zeros).sum(dim=1)

    # ---- positives ----
    if w.positive == "contrastive":
        positive = torch.where(positives, 1 - similarity, zeros).sum(dim=1)
    elif w.positive == "binomial":
        positive = torch.where(positives, F.softplus(w.alpha * (w.threshold - similarity)), zeros).sum(dim=1) / w.alpha
    elif w.positive == "ms":
        exponents = torch.where(positives, w.alpha * (w.threshold - similarity), infinity)
        positive = F.softplus(torch.logsumexp(exponents, dim=1)) / w.alpha          # log(1 + sum e^x)
    else:   # infonce, negatives detached: the gradient reaches the positives only
        terms = _infonce_terms(similarity / tau, negatives_lse(similarity.detach()))
        positive = torch.where(positives, terms, zeros).sum(dim=1)

    # ---- negatives ----
    if w.negative == "hll":
        negative = torch.where(negatives, hll_integral(similarity, w.hll_a, w.hll_b), zeros).sum(dim=1)
    elif w.negative == "binomial":
        negative = torch.where(negatives, F.softplus(w.beta * (similarity - w.threshold)), zeros).sum(dim=1) / w.beta
    elif w.negative == "ms":
        exponents = torch.where(negatives, w.beta * (similarity - w.threshold), infinity)
        negative = F.softplus(torch.logsumexp(exponents, dim=1)) / w.beta
    else:   # infonce, positives detached: the gradient reaches the negatives only
        terms = _infonce_terms(similarity.detach() / tau, negatives_lse(similarity))
        negative = torch.where(positives, terms, zeros).sum(dim=1)
    return positive + negative
