"""The training clock of a run (engine.max_minutes, engine.checkpoint_every_minutes): the seconds it has trained, across
resumes, and its minute marks."""
from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager


class TrainingClock:
    """The seconds a run has trained, across resumes: a resumed run starts from the checkpoint's count, so a run
    killed and resumed does not restart its time budget. Checkpoint writes and end-of-epoch evaluations are left
    out (`paused`): they measure the run, and a benchmark's evaluation marks must not cost its training time."""

    def __init__(self, seconds: float = 0.0):
        self.origin = time.perf_counter() - seconds

    def seconds(self) -> float:
        return time.perf_counter() - self.origin

    @contextmanager
    def paused(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.origin += time.perf_counter() - started


def next_minute_mark(trained_seconds: float, mark_s: float) -> float:
    """The first multiple of `mark_s` past `trained_seconds` (inf when there are no minute marks)."""
    return (math.floor(trained_seconds / mark_s) + 1) * mark_s if mark_s else math.inf
