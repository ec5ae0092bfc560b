"""SupCon, the supervised contrastive loss L_out^sup, with k >= 2 views per image, with or without labels.

Khosla et al., "Supervised Contrastive Learning", NeurIPS 2020, as written in Animesh & Chandraker, "Tuned
Contrastive Learning" (TCL), eqs. 1-3, with the gradient of Lemma 1 (eqs. 4-7):

    L_i = -1/|P(i)| sum_{p in P(i)} log( exp(z_i.z_p / t) / D(z_i) )                               (2)
    D(z_i) = sum_{p' in P(i)} exp(z_i.z_p' / t) + sum_{n in N(i)} exp(z_i.z_n / t)                 (3)

over the batch I of all B k views (every view is an anchor i). P(i) holds the other views of i's image and,
when labels are given, every view of every image with i's label; never i itself. N(i) = I \\ (P(i) u {i}).
Without labels (self-supervised) P(i) is only the other k - 1 views of the same image.

Eq. 1 sums L_i over the anchors; the training loss here is their mean, which only divides the learning rate
by the number of anchors (B k). The positive / negative sets are built once, in `contrast_set`, which the
TCL loss (pretrain/losses/tcl.py) uses too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_gather

# How far |z| may be from 1 before the inputs count as not normalised (bf16 projections stay well inside).
NORM_TOLERANCE = 1e-2


@dataclass
class ContrastSet:
    """The anchors of one loss call and what each is contrasted with.

    dots: (A, M) z_i . z_a for every local anchor i and every candidate a. Anchors are the A = B k local views,
        image-major (anchor b k + v is view v of image b); candidates are the M views of the batch I, those of
        every process when negatives are gathered (M = W B k), in the same order, process by process.
    positives: (A, M) bool, P(i).
    negatives: (A, M) bool, N(i) = I minus P(i) and i itself.
    views: k, the views per image.
    """

    dots: torch.Tensor
    positives: torch.Tensor
    negatives: torch.Tensor
    views: int

    def mean_over(self, values: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
        """(A, M) values -> (A,) their mean over each anchor's `members` (0 for an anchor without any)."""
        total = torch.where(members, values, torch.zeros_like(values)).sum(dim=1)
        return total / members.sum(dim=1).clamp(min=1)

    def per_sample(self, per_anchor: torch.Tensor) -> torch.Tensor:
        """(B k,) per-anchor losses -> (B,) the mean over each image's k anchors."""
        return per_anchor.view(-1, self.views).mean(dim=1)

    def figure3_means(self, positive_coefficients: torch.Tensor,
                      negative_coefficients: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """TCL sec. 4.4 / Figure 3: per anchor, the mean over P(i) of the positives' gradient coefficients and
        the mean over N(i) of the negatives', each averaged over the anchors whose set is not empty (0 when no
        anchor has one). Returns (grad_pos, grad_neg) as 0-dim tensors."""
        means = []
        for coefficients, members in ((positive_coefficients, self.positives),
                                      (negative_coefficients, self.negatives)):
            present = members.any(dim=1)
            per_anchor = self.mean_over(coefficients, members)[present]
            means.append(per_anchor.mean() if per_anchor.numel() else per_anchor.new_zeros(()))
        return means[0], means[1]


def contrast_set(z: torch.Tensor, labels: torch.Tensor | None = None, gather_negatives: bool = False) -> ContrastSet:
    """The similarities and the P(i) / N(i) masks of SupCon and TCL (TCL eqs. 2-3 and 9-11).

    Args:
        z: (B, k, D) L2-normalised embeddings, k >= 2 views of each of B images (k = 1 with labels: the
            deep-metric-learning batch of one view per image, positives from the labels only).
        labels: (B,) class labels >= 0 (supervised: views of images with the same label are positives too),
            or None (self-supervised: only the other views of the same image are).
        gather_negatives: when a process group of several processes is initialised, the batch I is every
            process's views (gradients flow back through the gather, as in pretrain/losses/ntxent.py); the
            anchors are always the local views. Every process must pass the same B.

    Example:
        >>> contrast = contrast_set(F.normalize(z, dim=-1), labels)
        >>> contrast.positives.sum(1)   # |P(i)| per anchor
    """
    if z.dim() != 3 or z.shape[1] < (2 if labels is None else 1):
        raise ValueError(f"z must be (B, k, D) with k >= 2 views per image (the other views are the positives; "
                         f"k >= 1 with labels); got shape {tuple(z.shape)}")
    with torch.no_grad():
        # Asserted on the device: RuntimeError at once on the CPU; on a GPU an asynchronous device-side assert (the
        # process stops at its next synchronisation), where reading the norms back would make the host wait for
        # the device's queue at every call, several a step under hard view selection.
        norms = z.detach().float().norm(dim=-1)
        torch._assert_async((norms - 1).abs().max() <= NORM_TOLERANCE,
                            f"z must be L2-normalised along its last dimension (|z| is more than {NORM_TOLERANCE} "
                            "from 1 for some view); pass F.normalize(z, dim=-1)")
    batch, views = z.shape[:2]
    if labels is not None:
        if labels.shape != (batch,):
            raise ValueError(f"labels must be (B,) = ({batch},) class indices, got shape {tuple(labels.shape)}")
        labels = labels.to(z.device)
        torch._assert_async((labels >= 0).all(), "labels contain negative values (-1: unknown class); pass "
                            "labels=None for the self-supervised loss, or labels of every image")   # as |z| above

    everyone, all_labels, offset = z, labels, 0
    if gather_negatives and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone = torch.cat(all_gather(z), dim=0)
        if labels is not None:
            gathered = [torch.empty_like(labels) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, labels)
            all_labels = torch.cat(gathered)
        offset = dist.get_rank() * batch

    anchors, candidates = z.flatten(0, 1), everyone.flatten(0, 1)               # (B k, D), (W B k, D)
    local = slice(offset * views, (offset + batch) * views)                     # the anchors among the candidates
    candidate_image = torch.arange(everyone.shape[0], device=z.device).repeat_interleave(views)
    related = candidate_image[local, None] == candidate_image[None, :]          # same image, anchor included
    if labels is not None:
        candidate_label = all_labels.repeat_interleave(views)
        related |= candidate_label[local, None] == candidate_label[None, :]
    itself = torch.zeros_like(related)
    own = torch.arange(batch * views, device=z.device)
    itself[own, own + local.start] = True
    return ContrastSet(dots=anchors @ candidates.T, positives=related & ~itself, negatives=~related, views=views)


def supcon_per_sample(z: torch.Tensor, labels: torch.Tensor | None, temperature: float,
                      gather_negatives: bool = False) -> torch.Tensor:
    """Per-sample SupCon loss (TCL paper eqs. 2-3): the mean of L_i over the k anchors of each image.

    Args:
        z: (B, k, D) L2-normalised embeddings of k >= 2 views of each image (F.normalize(proj(x), dim=-1)).
        labels: (B,) class labels, or None for the self-supervised loss (see `contrast_set`).
        temperature: t > 0 (SupCon and TCL use 0.1).
        gather_negatives: contrast with the views of every process (see `contrast_set`).

    Returns:
        (B,) losses; their mean is the mean of L_i over all anchors (eq. 1 up to the factor B k).

    Example:
        >>> z = F.normalize(projector(backbone(views.flatten(0, 1))), dim=-1).unflatten(0, (B, k))
        >>> loss = supcon_per_sample(z, labels, temperature=0.1).mean()
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be positive (SupCon uses 0.1)")
    contrast = contrast_set(z, labels, gather_negatives)
    return contrast.per_sample(_supcon_per_anchor(contrast, temperature))


def _supcon_per_anchor(contrast: ContrastSet, temperature: float) -> torch.Tensor:
    """(A,) L_i of eq. 2 for every anchor (unchecked; tests take per-anchor gradients through it)."""
    logits = contrast.dots / temperature
    contrasted = contrast.positives | contrast.negatives                        # A(i) = P(i) u N(i)
    log_denominator = torch.logsumexp(logits.masked_fill(~contrasted, float("-inf")), dim=1)   # eq. 3
    # eq. 2: -1/|P| sum_p (z_i.z_p / t - log D) = log D - mean_p z_i.z_p / t
    return log_denominator - contrast.mean_over(logits, contrast.positives)


@torch.no_grad()
def supcon_gradient_means(z: torch.Tensor, labels: torch.Tensor | None, temperature: float,
                          gather_negatives: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The Figure-3 quantities of the TCL paper (sec. 4.4) for SupCon, from the terms of Lemma 1 (eqs. 4-7).

    grad_pos: per anchor the mean over its positives of |X_ip - P^s_ip| (the right side of eq. 17, SupCon's
        hard-positive gradient coefficient), averaged over anchors.
    grad_neg: per anchor the mean over its negatives of P^s_in (eq. 7), averaged over anchors (those with
        negatives).
    As in eq. 17 the common factor 1/t of eq. 4 is left out. Arguments as in `supcon_per_sample`.

    Example:
        >>> grad_pos, grad_neg = supcon_gradient_means(z, labels, temperature=0.1)
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be positive (SupCon uses 0.1)")
    return _supcon_gradient_means(contrast_set(z, labels, gather_negatives), temperature)


def supcon_loss_and_gradient_means(z: torch.Tensor, labels: torch.Tensor | None, temperature: float,
                                   gather_negatives: bool = False
                                   ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """`supcon_per_sample` and `supcon_gradient_means` of the same inputs from one contrast set (one gather,
    one similarity matrix): what a training step that logs the Figure-3 values needs."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be positive (SupCon uses 0.1)")
    contrast = contrast_set(z, labels, gather_negatives)
    return (contrast.per_sample(_supcon_per_anchor(contrast, temperature)),
            _supcon_gradient_means(contrast, temperature))


@torch.no_grad()
def _supcon_gradient_means(contrast: ContrastSet, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    logits = contrast.dots / temperature
    contrasted = contrast.positives | contrast.negatives
    share = torch.softmax(logits.masked_fill(~contrasted, float("-inf")), dim=1)   # P^s_ia, eqs. 6-7
    x = 1.0 / contrast.positives.sum(dim=1, keepdim=True).to(contrast.dots.dtype)      # X_ip, eq. 5
    return contrast.figure3_means((x - share).abs(), share)
