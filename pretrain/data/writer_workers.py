"""FFCV's writer workers, as `write_beton` runs them: killed with the thread that forked them (a write killed with
SIGKILL leaves none running), and watched for an early end (an exception, a segfault, the OOM killer, a full disk),
which FFCV's parent would otherwise wait for forever: checked after each nap of its wait, in the writing thread."""
from __future__ import annotations

import ctypes
import errno
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_CHILDREN_DIE_WITH_THEIR_PARENT = False


def _die_with_parent_after_fork() -> None:
    if _CHILDREN_DIE_WITH_THEIR_PARENT and sys.platform == "linux":
        parent = os.getppid()
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)     # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:                                     # the parent died before prctl took effect
            os._exit(1)


os.register_at_fork(after_in_child=_die_with_parent_after_fork)


@contextmanager
def children_die_with_their_parent() -> Iterator[None]:
    """Processes forked inside this block (FFCV's writer workers) are killed when the thread that forked them ends:
    a write killed with SIGKILL would otherwise leave a worker running on, which keeps the shared memory and the
    partial file in use until the machine restarts."""
    global _CHILDREN_DIE_WITH_THEIR_PARENT
    _CHILDREN_DIE_WITH_THEIR_PARENT = True
    try:
        yield
    finally:
        _CHILDREN_DIE_WITH_THEIR_PARENT = False


def run_watching_workers_and_disk(write, tmp: Path, page_size: int) -> None:
    """Run FFCV's `write()` while watching its worker processes. FFCV's parent waits for its workers' progress
    without looking at them (`ffcv.writer`'s loop: read their count of samples done, `sleep(0.1)`, read again), so it
    would wait forever when a worker ends before the write is done (an exception in the dataset, a segfault, the
    OOM killer, a full disk). After each of those naps (`checks_in_ffcvs_wait`) this looks at the process's children
    and, when a worker of this write has ended with an error, or every worker had already ended two looks before
    (their work was all counted then: the loop reads the count and naps once more at most, so it waits for a worker
    reaped unseen), terminates the others and raises from inside FFCV's loop, which catches nothing, again at every
    later nap:
    - OSError (ENOSPC) when the filesystem has no room for another page (the workers die on "no space left");
    - else a ChildProcessError naming the worker's exit (its traceback, if any, is above on stderr).
    Either way the caller removes the partial file. FFCV's own errors are raised as they are.

    Synchronous, in the thread that writes: no signal handler and no thread of ours. A SIGCHLD handler did this until
    2026-11-29; it raised wherever the main thread happened to be, and an `except OSError` on the way (its own /proc
    reads, entered again by a second worker's signal) or a garbage collector's finalizer swallowed the error, leaving
    FFCV waiting for workers that were gone (one write in some 300 on a busy CPU; a fresh clone's `make test` hung).
    And no thread beside FFCV's fork: a worker forked beside another thread inherits whatever that thread held at
    the moment of the fork (numba's TBB pool is fork-safe only from the main thread)."""
    children_before = set(child_processes())
    seen: set[int] = set()
    looks_since_all_ended = 0
    raised: OSError | None = None

    def check_workers() -> None:
        nonlocal looks_since_all_ended, raised
        if raised is not None:      # raised before and caught on the way: FFCV waits on, so again
            raise raised
        children = {pid: status for pid, status in child_processes().items() if pid not in children_before}
        seen.update(children)
        failed = {pid: status for pid, status in children.items() if status not in (None, 0)}
        all_ended = bool(seen) and all(children.get(pid, 0) is not None for pid in seen)     # gone: reaped
        looks_since_all_ended = looks_since_all_ended + 1 if all_ended else 0
        # FFCV's loop naps once more after reading the last count: a third look with every worker ended is a stall
        if not failed and looks_since_all_ended < 3:
            return
        if shutil.disk_usage(tmp.parent).free < page_size:
            raised = OSError(errno.ENOSPC, f"no space left on device while writing {tmp.parent} "
                                           f"({shutil.disk_usage(tmp.parent).free} bytes free): free some space, "
                                           "or write the .beton elsewhere (--out)")
        elif failed:
            pid, status = next(iter(failed.items()))
            code = os.waitstatus_to_exitcode(status)
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
            raised = ChildProcessError(f"an FFCV writer worker (pid {pid}) ended with {how} before the write to "
                                       f"{tmp.parent} was done (its error, if it printed one, is above); nothing "
                                       "was written: run the write again")
        else:
            raised = ChildProcessError(f"FFCV's writer workers (pids {', '.join(map(str, sorted(seen)))}) all ended "
                                       f"before the write to {tmp.parent} was done (one ended early and was reaped "
                                       "before its exit could be read; its error, if it printed one, is above); "
                                       "nothing was written: run the write again")
        stop_workers(children_before)
        raise raised

    with checks_in_ffcvs_wait(check_workers):
        try:
            write()
        except OSError as error:                     # ChildProcessError is one
            if error is not raised:
                raise
            # without FFCV's frames, which hold its progress bar: it closes (prints) now, not after the error is told
            raise error.with_traceback(None) from None


_CHECKS: dict[int, object] = {}       # thread id -> the check of the write that thread runs


def _sleep_then_check(seconds: float) -> None:
    time.sleep(seconds)
    check = _CHECKS.get(threading.get_ident())
    if check is not None:
        check()


@contextmanager
def checks_in_ffcvs_wait(check) -> Iterator[None]:
    """While inside, FFCV's writer calls `check()` after each nap of its wait for the workers (`ffcv.writer`'s
    module-level `sleep`, the only hook its loop offers), in the thread that writes; a write in another thread keeps
    its own check. Outside, `ffcv.writer.sleep` is `time.sleep` again."""
    import ffcv.writer

    _CHECKS[threading.get_ident()] = check
    ffcv.writer.sleep = _sleep_then_check
    try:
        yield
    finally:
        del _CHECKS[threading.get_ident()]
        if not _CHECKS:
            ffcv.writer.sleep = time.sleep


def stop_workers(children_before: set[int]) -> None:
    """Terminate this process's multiprocessing children but those in `children_before` (FFCV's writer workers are
    the others), and reap them."""
    workers = [child for child in multiprocessing.active_children() if child.pid not in children_before]
    for worker in workers:
        worker.terminate()
    for worker in workers:
        worker.join(5)


def child_processes() -> dict[int, int | None]:
    """This process's children (Linux): pid -> None while it runs (or is exiting), its wait status once it has ended
    and is not yet reaped (a zombie: read from /proc without reaping it, so multiprocessing still joins it)."""
    children = {}
    for stat in child_stats():
        fields = stat.rsplit(")", 1)[1].split()
        children[int(stat.split()[0])] = int(fields[49]) if fields[0] == "Z" else None   # proc(5): (52) exit_code
    return children


def child_stats() -> Iterator[str]:
    """/proc/PID/stat of each of this process's children (none where there is no /proc)."""
    for listing in Path("/proc/self/task").glob("*/children"):
        try:
            pids = listing.read_text().split()
        except OSError:                             # a thread that ended meanwhile
            continue
        for pid in pids:
            try:
                yield Path(f"/proc/{pid}/stat").read_text()
            except OSError:                         # reaped meanwhile
                continue
