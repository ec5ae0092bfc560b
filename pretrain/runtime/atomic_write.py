"""Files that a reader may see while they are written (results, trainer state, indexes, caches) are written to a
temporary name and renamed: a crash or a full disk leaves the previous version, never half a file."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """Produce `path` with `write(temporary path)` (`Path.write_text`, `torch.save`, ...) and a rename: readers see
    the old or the new file, and a failed write (a full disk) leaves no temporary file behind and names `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as error:
        if error.filename is None:     # a full disk found when the data is flushed: the error names no file
            error.filename = str(path)
        raise
    finally:
        with contextlib.suppress(OSError):    # e.g. a folder that is a file: the write's own error is the one to see
            tmp.unlink(missing_ok=True)


def write_text_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename (`write_atomically`)."""
    write_atomically(path, lambda tmp: tmp.write_text(text))
