"""NT-Xent, the normalised temperature-scaled cross-entropy of SimCLR.

Chen et al., "A Simple Framework for Contrastive Learning of Visual Representations", ICML 2020, eq. 1;
per-sample form as used for hard view selection in HVS (Ferreira et al.), appendix H.1, eq. 3:

    l(i, j) = -log  exp(sim(z_i, z_j) / t) / sum_{k != i} exp(sim(z_i, z_k) / t)

over the 2B embeddings of the two views of a batch (2B - 1 candidates per anchor), sim = cosine.
The loss of sample i is the mean of its two directions, (l(a_i, b_i) + l(b_i, a_i)) / 2, as the HVS authors'
SimCLR (automl/hvp) and lightly take it; `directions="sum"` is google-research/simclr's (objective.py:86,
`loss = loss_a + loss_b`): twice the loss, which with LARS is not only a learning rate (LARS scales each layer's step
by its weight norm over its gradient's, so the decay of the LARS-scaled layers weighs half as much, and the step of
the layers LARS leaves out, BatchNorm and biases, doubles).

Balance (Sors et al., "Simple and Effective Balance of Contrastive Losses", paper 000, eqs. 3-5 and 8):
with d = 1 - sim, l(i, j) = l_p + l_e, the positive term l_p = d(z_i, z_j) / t and the entropy term
l_e = log sum_{k != i} exp(-d(z_i, z_k) / t) (K_ij = {j} and the negatives of i, SimCLR's 2B - 1
candidates); `lambda_p` and `lambda_e` weight them, lambda_p * l_p + lambda_e * l_e. lambda_p = lambda_e = 1
is NT-Xent and computed exactly as without the option.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.nn.functional import all_gather


DIRECTIONS = ("mean", "sum")


def nt_xent_per_sample(z_a: torch.Tensor, z_b: torch.Tensor, temperature: float,
                       gather_negatives: bool = False, lambda_p: float = 1.0, lambda_e: float = 1.0,
                       directions: str = "mean") -> torch.Tensor:
    """Per-sample NT-Xent loss.

    Args:
        z_a, z_b: (B, D) embeddings of two views of the same B images (row i of each is image i).
        temperature: softmax temperature t > 0 (SimCLR: 0.1-0.5).
        gather_negatives: when a process group is initialised, use the embeddings of every process as
            negatives (gradients flow back through the gather); otherwise only the local batch.
        lambda_p, lambda_e: weights of the positive and the entropy term (paper 000, eq. 5); >= 0, and 1, 1 is
            NT-Xent.
        directions: "mean" (automl/hvp, lightly) or "sum" (google-research/simclr) of the two directions' losses.

    Returns:
        (B,) loss of every local sample.

    Example:
        >>> loss = nt_xent_per_sample(proj(view1), proj(view2), temperature=0.2).mean()
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be positive (SimCLR uses 0.1-0.5)")
    if min(lambda_p, lambda_e) < 0:
        raise ValueError(f"lambda_p={lambda_p} and lambda_e={lambda_e} must be >= 0 (1 and 1: NT-Xent)")
    if directions not in DIRECTIONS:
        raise ValueError(f"directions={directions!r} must be one of {DIRECTIONS} (how the two directions' losses "
                         "combine: mean, or google-research/simclr's sum)")
    if z_a.shape != z_b.shape or z_a.dim() != 2:
        raise ValueError(f"z_a and z_b must both be (B, D); got {tuple(z_a.shape)} and {tuple(z_b.shape)}")
    z_a, z_b = F.normalize(z_a, dim=1), F.normalize(z_b, dim=1)
    batch = z_a.shape[0]
    offset = 0
    all_a, all_b = z_a, z_b
    if gather_negatives and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        all_a = torch.cat(all_gather(z_a), dim=0)
        all_b = torch.cat(all_gather(z_b), dim=0)
        offset = dist.get_rank() * batch
    candidates = torch.cat([all_a, all_b], dim=0)             # (2 W B, D)
    total = all_a.shape[0]
    own = torch.arange(batch, device=z_a.device) + offset     # index of each local anchor in all_a / all_b

    def one_direction(anchors: torch.Tensor, self_index: torch.Tensor, positive_index: torch.Tensor):
        logits = anchors @ candidates.T / temperature
        logits = logits.scatter(1, self_index[:, None], float("-inf"))   # an anchor is not its own candidate
        if lambda_p == 1 and lambda_e == 1:
            return F.cross_entropy(logits, positive_index, reduction="none")
        # l_p = (1 - sim_ij) / t and l_e = logsumexp_k (sim_ik - 1) / t: the 1/t constants cancel in their sum
        positive = 1 / temperature - logits.gather(1, positive_index[:, None]).squeeze(1)
        entropy = torch.logsumexp(logits, dim=1) - 1 / temperature
        return lambda_p * positive + lambda_e * entropy

    both = one_direction(z_a, own, own + total) + one_direction(z_b, own + total, own)
    return both if directions == "sum" else 0.5 * both
