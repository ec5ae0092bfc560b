"""The DINO loss: cross-entropy between a centred, sharpened teacher and a student, over multi-crop views.

Caron et al., "Emerging Properties in Self-Supervised Vision Transformers", ICCV 2021, eq. 2-3 and
Algorithm 1: with P_t = softmax((g_t(x) - c) / tau_t) and P_s = softmax(g_s(x') / tau_s),

    H(P_t(x), P_s(x')) = - sum_k P_t(x)_k log P_s(x')_k

is summed over every teacher view x (the global crops) and every student view x' != x (all crops), then,
as facebookresearch/dino `DINOLoss.forward`, divided by the number of terms. The teacher side carries no
gradient (stop-gradient). Hard view selection (Ferreira et al., sec. 3.3) needs the per-sample form, so
the batch mean is left to the caller.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _check_inputs(student_logits: torch.Tensor, teacher_logits: torch.Tensor, center: torch.Tensor,
                  student_temp: float, teacher_temp: float) -> None:
    if student_temp <= 0 or teacher_temp <= 0:
        raise ValueError(f"student_temp={student_temp} and teacher_temp={teacher_temp} must be positive "
                         "(DINO: student 0.1, teacher 0.04-0.07)")
    if student_logits.dim() != 3 or teacher_logits.dim() != 3:
        raise ValueError(f"student_logits must be (B, S, K) and teacher_logits (B, T, K); got "
                         f"{tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}. Stack the views "
                         "on dim 1 (e.g. outputs['student'] of the DINO method).")
    (b_s, _, k_s), (b_t, _, k_t) = student_logits.shape, teacher_logits.shape
    if b_s != b_t or k_s != k_t:
        raise ValueError(f"student_logits {tuple(student_logits.shape)} and teacher_logits "
                         f"{tuple(teacher_logits.shape)} must agree in batch size B and prototypes K")
    if center.shape != (k_t,):
        raise ValueError(f"center must be a (K,) = ({k_t},) vector of mean teacher logits; got {tuple(center.shape)}")


def dino_cross_entropy_table(student_logits: torch.Tensor, teacher_logits: torch.Tensor, center: torch.Tensor,
                             student_temp: float, teacher_temp: float) -> torch.Tensor:
    """H(P_t(view i), P_s(view j)) for every teacher view i and student view j of every sample.

    Args:
        student_logits: (B, S, K) student head outputs of S views (prototype scores, before softmax).
        teacher_logits: (B, T, K) teacher head outputs of T views; no gradient flows into them.
        center: (K,) running mean of the teacher logits, subtracted before the teacher softmax.
        student_temp: tau_s > 0 (DINO: 0.1).
        teacher_temp: tau_t > 0 (DINO: 0.04, warmed up to 0.07 at most).

    Returns:
        (B, T, S) cross-entropies, in nats.

    Example:
        >>> table = dino_cross_entropy_table(student, teacher, center, 0.1, 0.04)   # (B, 2, 10)
        >>> table[:, 0, 3]   # teacher on global crop 0 vs student on local crop 1 (flat view 3)
    """
    _check_inputs(student_logits, teacher_logits, center, student_temp, teacher_temp)
    teacher_probs = F.softmax((teacher_logits.detach() - center) / teacher_temp, dim=-1)
    student_log_probs = F.log_softmax(student_logits / student_temp, dim=-1)
    return -torch.einsum("btk,bsk->bts", teacher_probs, student_log_probs)


def dino_loss_per_sample(student_logits: torch.Tensor, teacher_logits: torch.Tensor, center: torch.Tensor,
                         student_temp: float, teacher_temp: float) -> torch.Tensor:
    """Per-sample DINO loss: the mean of H(P_t(view i), P_s(view j)) over all i and j != i.

    The first T student views must be the same crops as the T teacher views (the global crops), in the
    same order: student view i is skipped against teacher view i, as `v == iq` in DINOLoss.

    Args: as `dino_cross_entropy_table`, with T <= S.

    Returns:
        (B,) loss of every sample; `.mean()` of it is DINOLoss's value.

    Example:
        >>> student = head(backbone(views)).view(B, 10, K)           # 2 globals then 8 locals
        >>> teacher = teacher_head(teacher_backbone(globals)).view(B, 2, K)
        >>> loss = dino_loss_per_sample(student, teacher, center, 0.1, 0.04).mean()
    """
    table = dino_cross_entropy_table(student_logits, teacher_logits, center, student_temp, teacher_temp)
    teachers, students = table.shape[1:]
    if teachers > students:
        raise ValueError(f"{teachers} teacher views but only {students} student views: the student sees every "
                         "teacher view (the globals) first, then the local crops")
    if students == 1:
        raise ValueError("one student view that is also the teacher's leaves no pair of different views; "
                         "pass at least two views")
    keep = torch.ones(teachers, students, dtype=torch.bool, device=table.device)
    keep[torch.arange(teachers), torch.arange(teachers)] = False
    return table[:, keep].mean(dim=1)


def dino_teacher_entropy(teacher_logits: torch.Tensor, center: torch.Tensor, teacher_temp: float) -> torch.Tensor:
    """H(P_t(view i)) = - sum_k P_t(x)_k log P_t(x)_k, in nats: (B, T, K) teacher logits -> (B, T).

    The cross-entropy of the loss splits as H(P_t, P_s) = H(P_t) + KL(P_t || P_s): a flatter teacher raises it
    whatever the student does (log K for a uniform teacher, 0 for a one-hot one). Hard view selection that
    scores by the cross-entropy therefore prefers views whose teacher output is flattest; scoring by the KL
    alone (`method.hvs_score=kl`) removes that term.
    """
    log_probs = F.log_softmax((teacher_logits.detach().float() - center) / teacher_temp, dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)
