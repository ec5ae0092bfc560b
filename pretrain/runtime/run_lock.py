"""One run per directory: RUN_DIR/run.lock names the process that trains in it.

Two runs in one directory would log every step twice and overwrite each other's checkpoints, so a second
start is refused while the first is alive. A run killed with SIGKILL (or a node that died) cannot remove its
lock, so a lock whose holder is gone is taken over, with a message:

- on the same host, the holder is gone when its pid no longer exists, or now belongs to another process
  (the recorded start time differs: pids are reused);
- a Slurm job that was requeued restarts under the same SLURM_JOB_ID, possibly on another host: a lock of
  the same job is always stale (the job's previous run ended when it was requeued);
- on another host, outside such a job, liveness cannot be checked: the start is refused and the message says
  which file to delete once that run is known to be gone.

Only rank 0 takes the lock (the ranks of one run share it); `locked_run_directory` tells every rank the outcome.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist


class RunDirectoryInUse(RuntimeError):
    """Another live run holds the run directory; the message says which and what to do."""


def process_start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat field 22), or None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[19])


def this_process() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start_ticks": process_start_ticks(os.getpid()),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "since": time.strftime("%Y-%m-%d %H:%M:%S")}


class RunLock:
    def __init__(self, run_dir: Path, name: str = "run.lock"):
        self.path = Path(run_dir) / name
        self.held = False

    def acquire(self) -> str | None:
        """Take the lock; return a message when a stale lock was taken over (None otherwise).

        Raises RunDirectoryInUse when a live run holds it.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        message = None
        for _ in range(50):
            if self._create():
                self.held = True
                return message
            holder = self._read_holder()
            if holder is None:            # being written by its creator right now, or torn: look again shortly
                time.sleep(0.1)
                if self._read_holder() is None and self._age_s() > 5:
                    holder = {}
                else:
                    continue
            reason = self._gone(holder)
            if reason is None:
                raise RunDirectoryInUse(
                    f"{self.path.parent} is in use by pid {holder.get('pid')} on {holder.get('host')} (since "
                    f"{holder.get('since')}): two runs in one directory would log every step twice and overwrite "
                    f"each other's checkpoints. Wait for that run to end or stop it, or start this one with another "
                    f"name=... . If that run is gone (e.g. its node died), delete {self.path}.")
            # Move the stale lock aside under a name of our own: of two starts taking it over at once, only one
            # rename succeeds; the other finds the new lock on its next attempt.
            aside = self.path.with_name(f"{self.path.name}.stale.{os.getpid()}")
            try:
                os.rename(self.path, aside)
            except FileNotFoundError:
                continue
            aside.unlink(missing_ok=True)
            message = (f"{self.path.parent}: took over the lock of an earlier run (pid {holder.get('pid')} on "
                       f"{holder.get('host')}, since {holder.get('since')}): {reason}")
        raise RunDirectoryInUse(f"could not take {self.path} after 50 attempts: other starts keep taking it")

    def release(self) -> None:
        """Remove the lock if this process still holds it."""
        if self.held and (self._read_holder() or {}).get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)
        self.held = False

    def _create(self) -> bool:
        try:
            descriptor = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(descriptor, "w") as file:
            json.dump(this_process(), file)
        return True

    def _read_holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            return None

    def _age_s(self) -> float:
        try:
            return time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return 0.0

    @staticmethod
    def _gone(holder: dict) -> str | None:
        """Why the holder is known to be gone, or None if it may be alive."""
        if not holder:
            return "the lock file was empty or unreadable"
        job = os.environ.get("SLURM_JOB_ID")
        if job is not None and holder.get("slurm_job_id") == job:
            return f"it belonged to this Slurm job ({job}), which was requeued"
        if holder.get("host") != socket.gethostname():
            return None
        if holder.get("pid") == os.getpid():
            return "it names this very process"
        ticks = process_start_ticks(int(holder.get("pid", -1)))
        if ticks is None:
            return "that process no longer exists"
        if holder.get("start_ticks") is not None and ticks != holder["start_ticks"]:
            return "its pid now belongs to another process"
        return None


@contextmanager
def locked_run_directory(run_dir: Path, rank: int) -> Iterator[None]:
    """Hold RUN_DIR/run.lock for the block: rank 0 takes it and every rank learns the outcome, so a refused
    start ends every process with the same message (RunDirectoryInUse) instead of leaving them waiting."""
    lock = RunLock(run_dir)
    outcome: list = [None, None]                      # (refusal, takeover message)
    if rank == 0:
        try:
            outcome[1] = lock.acquire()
        except RunDirectoryInUse as error:
            outcome[0] = str(error)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise RunDirectoryInUse(outcome[0])
    if outcome[1] is not None and rank == 0:
        print(outcome[1], file=sys.stderr, flush=True)
    try:
        yield
    finally:
        lock.release()
