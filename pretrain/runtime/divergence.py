"""What a training run raises when it diverges (the loss or the parameters became NaN or inf)."""
from __future__ import annotations


class TrainingDiverged(RuntimeError):
    """The loss or the parameters became NaN / inf; the message names the step and what to try."""


class NonFiniteLoss(Exception):
    """Raised on every rank before the backward of a loss that is NaN or inf on any rank."""

    def __init__(self, value: float):
        super().__init__(f"non-finite loss {value}")
        self.value = value
