"""Hard view selection (Ferreira et al., "Hard View Selection for Contrastive Learning", sec. 3.2, eq. 2).

Per sample: one no-grad forward of all N views, the per-sample loss of every candidate combination of
views (for pair methods the N(N-1)/2 pairs), and the hardest combination is what the normal training step
then trains on. Written once for every method through the method protocol (pretrain/methods/__init__.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from pretrain.data.views import pair_iou


@dataclass
class Selection:
    """The chosen views of every sample and what the selection saw.

    views: (B, k, C, H, W) chosen views, in combination order.
    boxes: (B, k, 4) their crop boxes.
    chosen: (B, k) indices of the chosen views among the N.
    scores: (B, C) per-sample loss of every candidate combination.
    stats: the hvs/* scalars (means over this process's batch).
    """

    views: torch.Tensor
    boxes: torch.Tensor
    chosen: torch.Tensor
    scores: torch.Tensor
    stats: dict[str, float]


@torch.no_grad()
def select_hard_views(forward: Callable[[torch.Tensor], dict], method, views: torch.Tensor,
                      boxes: torch.Tensor, mode: str = "hard", selection_size: int | None = None) -> Selection:
    """Choose, per sample, the candidate combination of views with the highest (mode="hard") or lowest
    (mode="easy", HVS appendix F.2) loss under the current model.

    Args:
        forward: the model's forward, e.g. the DeepSpeed engine; called once on all N views.
        method: provides `candidates(N)` and `sample_loss(outputs, combination) -> (B,)`.
        views: (B, N, C, H, W) pool of views; boxes: (B, N, 4) their crop boxes (normalised).
        selection_size: if set, the selection forward runs on views resized to this side (cheaper).
    """
    if mode not in ("hard", "easy"):
        raise ValueError(f"hvs.mode={mode!r} must be 'hard' or 'easy'")
    batch, num_views = views.shape[:2]
    pool = views
    if selection_size and selection_size != views.shape[-1]:
        pool = F.interpolate(views.flatten(0, 1), size=selection_size, mode="bilinear", antialias=True,
                             align_corners=False).unflatten(0, (batch, num_views))
    outputs = {name: tensor.float() for name, tensor in forward(pool).items()}   # scores in fp32 under bf16
    combinations = method.candidates(num_views)
    scores = torch.stack([method.sample_loss(outputs, c).float() for c in combinations], dim=1)   # (B, C)
    pick = scores.argmax(dim=1) if mode == "hard" else scores.argmin(dim=1)
    table = torch.tensor(combinations, device=views.device)                                       # (C, k)
    chosen = table[pick]                                                                          # (B, k)
    rows = torch.arange(batch, device=views.device)[:, None]
    stats = selection_stats(scores, pick, boxes, table)
    return Selection(views=views[rows, chosen], boxes=boxes[rows, chosen], chosen=chosen, scores=scores,
                     stats=stats)


def selection_stats(scores: torch.Tensor, pick: torch.Tensor, boxes: torch.Tensor,
                    table: torch.Tensor) -> dict[str, float]:
    """The scalars of HVS sec. 5.1: loss and IoU of the chosen pair against the mean over all pairs, and the
    share of samples whose chosen pair is also their lowest-IoU pair (chance: 1 / number of pairs).

    For combinations of more than two views the IoU is that of the first two (e.g. DINO's two globals).
    """
    batch = scores.shape[0]
    rows = torch.arange(batch, device=scores.device)
    ious = pair_iou(boxes[:, table[:, 0]], boxes[:, table[:, 1]])                                 # (B, C)
    return {
        "hvs/selected_loss": scores[rows, pick].mean().item(),
        "hvs/mean_pair_loss": scores.mean().item(),
        "hvs/selected_iou": ious[rows, pick].mean().item(),
        "hvs/mean_pair_iou": ious.mean().item(),
        "hvs/lowest_iou_chosen_frac": (pick == ious.argmin(dim=1)).float().mean().item(),
    }
