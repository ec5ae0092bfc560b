"""SIGINT / SIGTERM / SIGUSR1 / SIGUSR2: finish the optimizer step under way, save a checkpoint, exit; a second
SIGINT or SIGTERM exits at once.

SIGUSR2 is the warning a cluster scheduler sends before a job's time limit or at preemption (`sbatch
--signal=USR2@SECONDS`, as submitit submits; `SlurmctldParameters=preempt_send_user_signal` for preemption):
the run stops the same way, with exit status 128 + SIGUSR2, and `launch` requeues the job, which resumes from
that checkpoint. SIGUSR1, which other job scripts ask the scheduler for, stops the run the same way (exit status
128 + SIGUSR1; such a script requeues the job itself). The scheduler's SIGTERM that may follow its warning belongs
to the same stop: it does not cut short the checkpoint being written (the scheduler's SIGKILL ends the job when it
must).

A handler only records the request; the training loop asks `agree()` once per optimizer step, an all-reduce
that also carries the training clock of a time budget, so that every process stops after the same step even
when the signal reached only one of them, and the checkpoint (a collective save under ZeRO) is written by all
of them together.

Launchers deliver one request twice: Ctrl-C reaches every process of the terminal's process group, and
torchrun then forwards the signal to its workers again. A repeat within `repeat_window_s` of the first
signal therefore counts as the same request; a signal after that exits at once with status 128 + signal.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

# A scheduler's warnings: SIGUSR2 is what `launch` asks Slurm for; SIGUSR1 is what many cluster scripts ask for
# (`sbatch --signal=B:USR1@120`), and its default action would kill the run without a checkpoint.
WARNINGS = (signal.SIGUSR1, signal.SIGUSR2)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, *WARNINGS)
PENDING_STOP_SIGNAL = "HARDVIEW_PENDING_STOP_SIGNAL"
WHY = {signal.SIGINT: "", signal.SIGTERM: "", signal.SIGUSR2: " (the scheduler's time-limit or preemption warning)",
       signal.SIGUSR1: " (a scheduler's time-limit or preemption warning)"}


class StopRequested(Exception):
    """The run stopped on a signal after saving a checkpoint; rerunning the same command resumes it."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class GracefulStop:
    def __init__(self, repeat_window_s: float = 2.0):
        self.repeat_window_s = repeat_window_s
        self.signum: int | None = None
        self.received_at = 0.0
        self.previous = {signum: signal.signal(signum, self._handle) for signum in STOP_SIGNALS}
        # A launched job records a stop signal that arrives during its start-up, before this handler exists
        # (launch.jobs.hold_stop_signals): it counts as received now.
        pending = os.environ.pop(PENDING_STOP_SIGNAL, None)
        if pending:
            self._handle(int(pending), None)

    def _handle(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum, self.received_at = signum, time.monotonic()
            print(f"{signal.Signals(signum).name}{WHY[signum]}: stopping after this optimizer step, with a "
                  "checkpoint (a second SIGINT / SIGTERM exits at once)", file=sys.stderr, flush=True)
        elif self.signum not in WARNINGS and signum not in WARNINGS and \
                time.monotonic() - self.received_at > self.repeat_window_s:
            print(f"{signal.Signals(signum).name} again: exiting now, without a checkpoint", file=sys.stderr,
                  flush=True)
            os._exit(128 + signum)

    def requested_on_any_rank(self, device: torch.device) -> int | None:
        """The signal number if any process received a stop signal (a collective: call it on every rank)."""
        return self.agree(device, 0.0)[0]

    def agree(self, device: torch.device, trained_seconds: float) -> tuple[int | None, float]:
        """The signal number if any process received a stop signal, and the largest of the processes'
        `trained_seconds` (their training clocks differ by milliseconds): one all-reduce, so that every process
        stops on a signal or at the time budget, and checkpoints at a minute mark, after the same step (a
        collective: call it on every rank). A single process has nothing to agree with: it reads its own values and
        touches no device (on a GPU, a tensor sent there and read back would wait for every queued kernel, once a
        step)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.signum, trained_seconds
        flags = torch.tensor([float(self.signum or 0), trained_seconds], device=device, dtype=torch.float64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signum, seconds = flags.tolist()
        return int(signum) or None, seconds

    def restore(self) -> None:
        """Put back the handlers that were installed before."""
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def __enter__(self) -> "GracefulStop":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()
