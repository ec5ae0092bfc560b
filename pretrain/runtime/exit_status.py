"""The exit statuses every training command shares (`python -m pretrain`, `python -m transfer finetune|detection`):
0 done, 1 diverged, 2 bad input (one line naming it; a run directory that cannot be written, read-only, without
permission, a file on its path or full, counts as one; `check_writable` finds all but the full disk before the work
starts), 128 + N stopped by signal N, 130 interrupted during start-up. Messages go to stderr, prefixed with the rank
when several processes run."""
from __future__ import annotations

import errno
import os
import sys
from pathlib import Path
from typing import Callable

from pretrain.runtime.config_error import ConfigError
from pretrain.runtime.distributed import release_distributed
from pretrain.runtime.divergence import TrainingDiverged
from pretrain.runtime.graceful_stop import StopRequested

# Why a file or folder cannot be written: the place, not the program, is at fault; said in one line, status 2.
UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR)


def check_writable(folder: str | Path) -> None:
    """Raise the OSError (naming the path) that writing into `folder` would raise, before the work whose output goes
    there starts (a run's processes and workers, a feature extraction of hours): a file on its path (ENOTDIR), a
    read-only filesystem (EROFS), no permission (EACCES). Nothing is created; a full disk is only found by writing."""
    folder = Path(folder)
    existing = next(path for path in (folder, *folder.parents) if path.exists())
    if not existing.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(existing))
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(existing))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(existing))


def create_run_directory(run_dir: Path) -> None:
    """Make the run's directory (and the folders above it). A place that refuses new folders for a reason
    `check_writable` cannot see without creating one (a kernel filesystem such as /proc: "No such file or directory")
    is a bad `run_dir`, said in one line (ConfigError), not a traceback."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        if error.errno in UNWRITABLE:                   # read-only, no permission, full: said as such
            raise
        raise ConfigError(f"cannot create the run directory {run_dir}: {error.strerror} ({error.filename}); choose "
                          "run_dir=PATH where folders can be created") from None


def first_missing_directory(path: Path) -> Path | None:
    """The outermost directory of `path` (itself included) that does not exist yet: what a start creates."""
    missing = None
    for candidate in [path, *path.parents]:
        if candidate.exists():
            return missing
        missing = candidate
    return missing


def report(message: str) -> None:
    """Print `message` to stderr, with `[rank R] ` in front when the job has several processes."""
    prefix = f"[rank {os.environ.get('RANK', '0')}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    print(f"{prefix}{message}", file=sys.stderr, flush=True)


def one_line(error: BaseException) -> str:
    """The error's message in one line. A DataLoader worker's error comes back as "Caught E in DataLoader worker
    process N. Original Traceback ...": its own message, the traceback's last line, is what says what to do."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Caught ") and lines[1].startswith("Original Traceback"):
        last = lines[-1]
        return last.split(": ", 1)[1] if ": " in last else last
    return " ".join(lines)


def exit_status_of(train: Callable[[], object], input_errors: tuple[type[BaseException], ...], what: str) -> int:
    """Call `train()` and turn how it ended into the exit status; `input_errors` are the bad-input errors
    (status 2), `what` names the work in the start-up interruption message ("training", "fine-tuning")."""
    try:
        train()
    except input_errors as error:
        report("error: " + one_line(error))
        return 2
    except OSError as error:
        if error.errno not in UNWRITABLE:
            raise
        report(f"error: cannot write {error.filename or 'the run directory'}: {error.strerror}; put the run on a "
               "writable filesystem with space left (run_dir=PATH), or free some space")
        return 2
    except TrainingDiverged as error:
        report(f"error: {error}")
        return 1
    except StopRequested as error:
        report(str(error))
        return error.exit_code
    except KeyboardInterrupt:          # Ctrl-C during the start-up, before train() handles signals
        report(f"interrupted before {what} began; nothing to save")
        return 130
    finally:
        release_distributed()
    return 0
