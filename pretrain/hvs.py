"""Hard view selection (Ferreira et al., "Hard View Selection for Contrastive Learning", sec. 3.2, eq. 2).

Per sample: one no-grad forward of the whole pool of views, the per-sample loss of every candidate
combination of views, and the hardest combination is what the normal training step then trains on.
Written once for every method through the method protocol (pretrain/methods/base.py).

A candidate takes, from every view group, as many views as the method trains on (`counts`) out of the
group's pool: SimCLR with a pool of 4 scores the 6 pairs; TCL with k = 3 of 5 views the 10 triplets; DINO
with pools [2, 2, 16] and counts [1, 1, 8] one global of each kind and 8 locals, C(16, 8) * 4 = 51,480
candidates, of which `max_candidates` are scored (HVS sec. 3.3 caps DINO at 128).
"""
from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import combinations, product
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.data.views import pair_iou


@dataclass
class Selection:
    """The chosen views of every sample and what the selection saw.

    views: per group, (B, count_g, C, H_g, W_g) chosen views, in combination order.
    boxes: per group, (B, count_g, 4) their crop boxes.
    chosen: (B, k) flat pool indices of the chosen views (group 0's pool first).
    scores: (B, C) per-sample loss of every scored candidate.
    stats: the hvs/* scalars (means over this process's batch), 0-d tensors.
    """

    views: list[torch.Tensor]
    boxes: list[torch.Tensor]
    chosen: torch.Tensor
    scores: torch.Tensor
    stats: dict[str, torch.Tensor]


def candidate_combinations(counts: Sequence[int], pools: Sequence[int], max_candidates: int = 0,
                           rng: random.Random | None = None) -> list[tuple[int, ...]]:
    """Every way to take `counts[g]` of the `pools[g]` views of each group, as flat pool indices.

    max_candidates: if positive and there are more candidates than this, that many distinct ones drawn
      uniformly at random (with `rng`) without listing them all; 0 means no cap (all are returned).
    """
    if max_candidates < 0:
        raise ValueError(f"max_candidates={max_candidates} must be >= 0 (0: no cap)")
    offsets = [sum(pools[:g]) for g in range(len(pools))]
    total = math.prod(math.comb(n, k) for n, k in zip(pools, counts))
    if max_candidates == 0 or total <= max_candidates:
        per_group = [[tuple(o + i for i in c) for c in combinations(range(n), k)]
                     for o, n, k in zip(offsets, pools, counts)]
        return [sum(parts, ()) for parts in product(*per_group)]
    rng = rng or random.Random(0)
    drawn: set[tuple[int, ...]] = set()
    while len(drawn) < max_candidates:
        drawn.add(sum((tuple(o + i for i in sorted(rng.sample(range(n), k)))
                       for o, n, k in zip(offsets, pools, counts)), ()))
    return sorted(drawn)


@contextmanager
def buffers_left_as_they_are(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Run a block whose forwards must not change any buffer of `modules`, bit for bit.

    The selection forward runs in train mode, as the HVS authors' code does, so BatchNorm normalises the
    pool with its batch statistics; but in train mode BatchNorm also folds those statistics into its running
    mean and variance. The pool (often at `selection_size`, a lower resolution) is not what the model trains
    on, and the running statistics are what the exported backbone is evaluated with, so they are restored.
    """
    # By name, not by tensor: a forward may replace buffer objects (DINO moves its teacher to the device in
    # its first forward), and the values must land in the buffers the module holds afterwards.
    saved = [(module, {name: buffer.clone() for name, buffer in module.named_buffers()}) for module in modules]
    try:
        yield
    finally:
        with torch.no_grad():
            for module, values in saved:
                for name, buffer in module.named_buffers():
                    buffer.copy_(values[name])


@torch.no_grad()
def select_hard_views(forward: Callable[[list[torch.Tensor]], dict], method, views: list[torch.Tensor],
                      boxes: list[torch.Tensor], labels: torch.Tensor, counts: Sequence[int], mode: str = "hard",
                      selection_size: int | None = None, max_candidates: int = 0,
                      rng: random.Random | None = None) -> Selection:
    """Choose, per sample, the candidate combination with the highest (mode="hard") or lowest (mode="easy",
    HVS appendix F.2) loss under the current model.

    Args:
        forward: the model's forward, e.g. the DeepSpeed engine; called once on the whole pool, in the mode
          the model is in (train mode in training). Every buffer of `method.modules_with_buffers()`
          (BatchNorm running statistics, DINO's teacher's) is left exactly as it was.
        method: provides `candidate_losses(outputs, combinations, labels) -> (B, C)`, `iou_views`,
          `selection_scalars(outputs, combinations, pick)` and `modules_with_buffers()`.
        views: per group, (B, pool_g, C, H, W) views; boxes: per group, (B, pool_g, 4) their crop boxes.
        labels: (B,) class labels (-1 unknown), for supervised methods.
        counts: views per group that one combination takes (the method's training views).
        selection_size: if set, the selection forward runs on views resized to this side, e.g. 16 for 32 px
          views (each group keeps its size relative to the largest).
        max_candidates, rng: see `candidate_combinations`.
    """
    if mode not in ("hard", "easy"):
        raise ValueError(f"hvs.mode={mode!r} must be 'hard' or 'easy'")
    pools = [v.shape[1] for v in views]
    pool = views
    largest = max(v.shape[-1] for v in views)
    if selection_size and selection_size != largest:
        pool = [F.interpolate(v.flatten(0, 1), size=max(1, round(v.shape[-1] * selection_size / largest)),
                              mode="bilinear", antialias=True, align_corners=False).unflatten(0, v.shape[:2])
                for v in views]
    with buffers_left_as_they_are(method.modules_with_buffers()):
        outputs = {name: tensor.float() for name, tensor in forward(pool).items()}   # scores in fp32 under bf16
    candidates = candidate_combinations(counts, pools, max_candidates, rng)
    scores = method.candidate_losses(outputs, candidates, labels).float()        # (B, C)
    pick = scores.argmax(dim=1) if mode == "hard" else scores.argmin(dim=1)
    device = views[0].device
    table = torch.tensor(candidates, device=device)                              # (C, k)
    chosen = table[pick]                                                          # (B, k)
    rows = torch.arange(chosen.shape[0], device=device)[:, None]
    chosen_views, chosen_boxes, start, offset = [], [], 0, 0
    for v, b, count, size in zip(views, boxes, counts, pools):
        local = chosen[:, start:start + count] - offset
        chosen_views.append(v[rows, local])
        chosen_boxes.append(b[rows, local])
        start, offset = start + count, offset + size
    all_boxes = torch.cat(boxes, dim=1)
    stats = {**selection_stats(scores, pick, all_boxes, table, method.iou_views),
             **method.selection_scalars(outputs, candidates, pick)}
    return Selection(views=chosen_views, boxes=chosen_boxes, chosen=chosen, scores=scores, stats=stats)


def selection_stats(scores: torch.Tensor, pick: torch.Tensor, boxes: torch.Tensor, table: torch.Tensor,
                    iou_views: int | None = None) -> dict[str, torch.Tensor]:
    """The scalars of HVS sec. 5.1: loss and IoU of the chosen combination against the mean over all
    candidates, and the share of samples whose chosen combination has their lowest IoU. Candidates can tie
    on IoU (DINO's IoU is that of the two globals, shared by every candidate with the same globals: with
    pools [2, 2, L] a quarter of them), so a sample counts when its chosen IoU equals the minimum; the
    chance level is the share of candidates at the minimum (1/6 for pairs of 4 views, about 1/4 for DINO).

    The IoU of a combination is the mean IoU over the pairs of its first `iou_views` views (None: all):
    for pairs the pair's IoU, for DINO that of its two global crops; its scale the mean area of those views' crop
    boxes (a fraction of the source image). A candidate of one view (the deep-metric-learning methods, one view per
    image) has no pair: then only the loss and scale scalars are returned. The values
    are 0-d tensors, read by the loop on the steps that log (`pretrain.runtime.task.Scalar`).
    """
    batch = scores.shape[0]
    rows = torch.arange(batch, device=scores.device)
    losses = {"hvs/selected_loss": scores[rows, pick].mean(), "hvs/mean_pair_loss": scores.mean()}
    members = table[:, :iou_views] if iou_views else table
    areas = (boxes[..., 2] - boxes[..., 0]) * (boxes[..., 3] - boxes[..., 1])           # (B, pool)
    scales = areas[:, members].mean(-1)                                                 # (B, C)
    losses.update({"hvs/selected_scale": scales[rows, pick].mean(), "hvs/mean_pair_scale": scales.mean()})
    if members.shape[1] < 2:
        return losses
    ious = torch.stack([pair_iou(boxes[:, members[:, a]], boxes[:, members[:, b]])
                        for a, b in combinations(range(members.shape[1]), 2)]).mean(0)   # (B, C)
    return {
        **losses,
        "hvs/selected_iou": ious[rows, pick].mean(),
        "hvs/mean_pair_iou": ious.mean(),
        "hvs/lowest_iou_chosen_frac": (ious[rows, pick] <= ious.min(dim=1).values).float().mean(),
    }
