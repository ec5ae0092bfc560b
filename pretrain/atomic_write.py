"""Files that a reader may see while they are written (results, trainer state, indexes) are written to a
temporary name and renamed: a crash or a full disk leaves the previous version, never half a file."""
from __future__ import annotations

import os
from pathlib import Path


def write_text_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename: readers see the old or the new file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
