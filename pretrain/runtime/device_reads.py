"""Counting the device-to-host reads a piece of code makes: the calls that, on a GPU, make the host wait until every
kernel queued before them has run (`.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `bool()` / `float()` / `int()` of a
tensor, `.to("cpu")`, `torch.cuda.synchronize()`).

A training step that reads nothing lets the host queue the next step's kernels while the device runs this one's;
one read a step stalls the host for the whole of the device's queue. `DeviceReads` patches those calls for the time
of a `with` block and counts them, with the line of this project's code that made each one, so that a test can
assert how many a step makes (tests/test_device_reads.py) and `bench train` can print them.

The count is of calls, whatever the tensor's device: on the CPU the same calls are the ones that would wait on a
GPU. A call made by a library (DeepSpeed, torch) on this project's behalf counts too, named by the project's line
that led to it. One exception: torch.optim's optimizers read their step counter (`_get_value(state["step"])`),
which torch keeps on the host unless the optimizer is capturable or fused: no wait, not counted.
"""
from __future__ import annotations

import collections
import sys
import traceback
from pathlib import Path
from types import FrameType
from typing import Any, Callable

import torch

READING_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
PROJECT_ROOT = Path(__file__).resolve().parents[2]


class DeviceReads:
    """A context manager that counts the reads made inside it, per `step` (`mark_step` starts the next one).

    `reads[i]` is a Counter of the call sites (`path:line method`, the innermost frame of this project's code
    outside this file) of step i's reads. Not thread-safe: a read from another thread (a loader's) counts for the
    step during which it happened."""

    def __init__(self) -> None:
        self.reads: list[collections.Counter] = [collections.Counter()]
        self.originals: dict[tuple[Any, str], Callable] = {}

    def mark_step(self) -> None:
        """The reads counted from here on belong to the next step."""
        self.reads.append(collections.Counter())

    def per_step(self) -> list[int]:
        """The number of reads before the first `mark_step` (index 0) and of each step since (1, 2, ...)."""
        return [sum(step.values()) for step in self.reads]

    def _record(self, what: str) -> None:
        site = "?"
        for frame in reversed(traceback.extract_stack()[:-2]):
            path = Path(frame.filename)
            if path.is_relative_to(PROJECT_ROOT) and path != Path(__file__) and ".venv" not in path.parts:
                site = f"{path.relative_to(PROJECT_ROOT)}:{frame.lineno}"
                break
        self.reads[-1][f"{site} {what}"] += 1

    def _patch(self, owner: Any, name: str, is_read: Callable[..., bool] = lambda *args, **kwargs: True) -> None:
        original = getattr(owner, name)
        self.originals[(owner, name)] = original
        record = self._record

        def counted(*args, **kwargs):
            if is_read(*args, **kwargs) and not reads_a_host_step_counter(sys._getframe(1)):
                record(name)
            return original(*args, **kwargs)
        setattr(owner, name, counted)

    def __enter__(self) -> "DeviceReads":
        for name in READING_METHODS:
            self._patch(torch.Tensor, name)
        self._patch(torch.Tensor, "to", is_read=moves_to_the_host)
        self._patch(torch.cuda, "synchronize")
        return self

    def __exit__(self, *exc) -> None:
        for (owner, name), original in self.originals.items():
            setattr(owner, name, original)
        self.originals.clear()


def reads_a_host_step_counter(caller: FrameType) -> bool:
    """Whether the read is torch.optim's of an optimizer's step counter (torch/optim/optimizer.py: `_get_value`)."""
    return caller.f_code.co_name == "_get_value" and Path(caller.f_code.co_filename).parent.name == "optim"


def moves_to_the_host(tensor: torch.Tensor, *args, **kwargs) -> bool:
    """Whether `tensor.to(*args, **kwargs)` names the host as its destination in a string ("cpu"): a read when the
    tensor is on a GPU. A torch.device argument is not counted: on the CPU it is the run's device as often as the
    host (`.to(device)`), and the two cannot be told apart there."""
    destination = kwargs.get("device", args[0] if args else None)
    return isinstance(destination, str) and torch.device(destination).type == "cpu"
