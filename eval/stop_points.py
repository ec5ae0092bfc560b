"""A stop asked for by a signal, taken at the next stop point of an evaluation rather than where the signal landed.

`python -m eval watch` stops on its job's time-limit warning (SIGUSR2) or SIGTERM and is requeued. Its handler used
to raise the stop where the main thread was: in numba's compiler (an FFCV loader compiles its pipeline at its first
batch) or in an LLVM object's disposal, cut in half, the watcher then crashed in libllvmlite (a segmentation fault
after "stopped on SIGUSR2": the job ended FAILED instead of requeued; the real-Slurm test on 2026-11-28). The handler
now only asks (`request_stop`), and the loops an evaluation spends its time in call `stop_point()`: feature
extraction before each batch (`eval/features.py`), the linear probe's training before each batch (`eval/linear.py`),
the watcher between evaluations and polls. The latency is one batch, or one compilation of a loader's pipeline.
"""
from __future__ import annotations

_requested: list[BaseException] = []


def request_stop(stop: BaseException) -> None:
    """Ask every later `stop_point()` to raise `stop` (the first request is kept); safe in a signal handler."""
    if not _requested:
        _requested.append(stop)


def stop_point() -> None:
    """Raise the requested stop, if any: where an evaluation can be stopped without harm."""
    if _requested:
        raise _requested[0]


def clear_stop_request() -> None:
    """Forget a request (the watcher, once it has stopped: the process may evaluate again, as a test's does)."""
    _requested.clear()


def sleep_to_stop_point(seconds: float) -> None:
    """Sleep `seconds`, a stop point every half second (a signal's handler that only asks does not end a sleep)."""
    import time

    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        stop_point()
        time.sleep(min(0.5, left))
    stop_point()
