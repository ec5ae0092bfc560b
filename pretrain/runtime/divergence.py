"""What a training run raises when it diverges (the loss or the parameters became NaN or inf), and the losses the
loop checks later than it computes them (`NonFiniteLosses`)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


class TrainingDiverged(RuntimeError):
    """The loss or the parameters became NaN / inf; the message names the step and what to try."""


class NonFiniteLoss(Exception):
    """Raised on every rank when a loss is NaN or inf on some rank: before the backward of the step that computed it
    (`step` None), or, for a loss noted on the device (`NonFiniteLosses`), at the check that found it (`step`: the
    step that computed it)."""

    def __init__(self, value: float | str, step: int | None = None):
        super().__init__(f"non-finite loss {value}" + (f" in step {step}" if step is not None else ""))
        self.value, self.step = value, step


class NonFiniteLosses:
    """The losses of the steps that read nothing back from the device, noted there: checking each as it is computed
    (`bool(torch.isfinite(loss))`) would make the host wait for the device's queue once a micro-batch, where the
    device could be running the step while the host queues the next.

    `note` keeps, on the device, the first step whose loss was NaN or inf on this process, and that loss; `raise_if_any`
    reads it (one all-reduce on several processes: the earliest step of any process) at the loop's next step that
    reads anyway, and raises NonFiniteLoss. The steps from that one to the check were applied; the loop checks before
    every checkpoint, so none of them is saved, and the run stops with its last finite checkpoint as it does for a
    loss found at once (where the step is not applied). Where the reference code checks every step (DINO's
    `math.isfinite(loss.item())`), the outcome is the same: the run stops, its last checkpoint finite."""

    def __init__(self, device: torch.device):
        self.first_step = torch.tensor(math.inf, dtype=torch.float64, device=device)   # inf: none yet
        self.first_loss = torch.tensor(0.0, dtype=torch.float32, device=device)
        self.unchecked = False           # a loss was noted since the last check (the same on every process)

    def note(self, loss: torch.Tensor, step: int) -> None:
        """Step `step`'s loss, checked on the device (nothing read back)."""
        first = ~torch.isfinite(loss.detach()).all() & torch.isinf(self.first_step)
        self.first_step = torch.where(first, float(step), self.first_step)
        self.first_loss = torch.where(first, loss.detach().float(), self.first_loss)
        self.unchecked = True

    def raise_if_any(self) -> None:
        """Raise NonFiniteLoss, on every rank, if a loss noted since the start was NaN or inf on some rank (a collective
        when losses were noted since the last check: call it on every rank)."""
        if not self.unchecked:
            return
        self.unchecked = False
        earliest = self.first_step.clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(earliest, op=dist.ReduceOp.MIN)
        step = earliest.item()
        if math.isfinite(step):
            own = self.first_step.item() == step
            raise NonFiniteLoss(self.first_loss.item() if own else "NaN or inf (on another process)", int(step))
