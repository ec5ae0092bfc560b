"""FFCV's writer workers, as `write_beton` runs them: killed with the thread that forked them (a write killed with
SIGKILL leaves none running), and watched for an early end (an exception, a segfault, the OOM killer, a full disk),
which FFCV's parent would otherwise wait for forever."""
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
    """Run FFCV's `write()` in this thread while watching its worker processes. FFCV's parent waits for its workers'
    progress without looking at them, so it would wait forever when a worker ends before the write is done (an
    exception in the dataset, a segfault, the OOM killer, a full disk). A worker's end reaches this process as
    SIGCHLD; the handler, run in this thread between two of FFCV's waits, terminates the other workers and raises:
    - OSError (ENOSPC) when the filesystem has no room for another page (the workers die on "no space left");
    - else a ChildProcessError naming the worker's exit (its traceback, if any, is above on stderr).
    Either way the caller removes the partial file. FFCV's own errors are raised as they are.

    No thread watches: FFCV forks its workers from this thread while no thread of ours runs (a worker forked beside
    another thread inherits whatever that thread held at the moment of the fork, and numba's TBB pool is fork-safe
    only from the main thread). Called from a thread other than the main one (where no signal handler can be set),
    FFCV writes unwatched."""
    if threading.current_thread() is not threading.main_thread():
        write()
        return
    children_before = set(child_processes())
    raised: list[BaseException] = []            # what the handler raised: it is told without FFCV's frames

    def on_a_child_ending(signum, frame) -> None:
        ended = {pid: status for pid, status in child_processes(settled=True).items()
                 if pid not in children_before and status not in (None, 0)}
        if not ended or raised:     # raised: the workers this handler stops end too, and signal again
            return
        if shutil.disk_usage(tmp.parent).free < page_size:
            raised.append(OSError(errno.ENOSPC, f"no space left on device while writing {tmp.parent} "
                                                f"({shutil.disk_usage(tmp.parent).free} bytes free): free some "
                                                "space, or write the .beton elsewhere (--out)"))
        else:
            pid, status = next(iter(ended.items()))
            code = os.waitstatus_to_exitcode(status)
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
            raised.append(ChildProcessError(f"an FFCV writer worker (pid {pid}) ended with {how} before the write "
                                            f"to {tmp.parent} was done (its error, if it printed one, is above); "
                                            "nothing was written: run the write again"))
        stop_workers(children_before)
        raise raised[0]

    previous = signal.signal(signal.SIGCHLD, on_a_child_ending)
    try:
        write()
    except (OSError, ChildProcessError) as error:
        if error not in raised:
            raise
        # without FFCV's frames, which hold its progress bar: it closes (prints) now, not after the error is told
        raise error.with_traceback(None) from None
    finally:
        signal.signal(signal.SIGCHLD, previous)


def stop_workers(children_before: set[int]) -> None:
    """Terminate this process's multiprocessing children but those in `children_before` (FFCV's writer workers are
    the others), and reap them."""
    workers = [child for child in multiprocessing.active_children() if child.pid not in children_before]
    for worker in workers:
        worker.terminate()
    for worker in workers:
        worker.join(5)


PF_EXITING = 0x4        # /proc/PID/stat's flags (proc(5), field 9): in do_exit, not yet a zombie


def child_processes(settled: bool = False) -> dict[int, int | None]:
    """This process's children (Linux): pid -> None while it runs, its wait status once it has ended and is not
    yet reaped (a zombie: read from /proc without reaping it, so multiprocessing still joins it). `settled`: first
    wait (up to 1 s) for exiting children to become zombies: the kernel sends SIGCHLD before it marks one (exit_notify),
    and a handler that looked once found the killed worker running and left FFCV waiting (a test hung, 2026-11-28)."""
    deadline = time.monotonic() + 1.0
    while True:
        children, exiting = {}, False
        for stat in child_stats():
            fields = stat.rsplit(")", 1)[1].split()
            children[int(stat.split()[0])] = int(fields[49]) if fields[0] == "Z" else None   # proc(5): (52) exit_code
            exiting |= fields[0] != "Z" and bool(int(fields[6]) & PF_EXITING)
        if not (settled and exiting) or time.monotonic() > deadline:
            return children
        time.sleep(0.001)


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
