"""What code and which machine a run started on, kept in its directory: RUN_DIR/provenance.json.

A number in a table is only as good as the knowledge of what produced it. A run resumed a day later may run at
another commit, with local edits, on another machine: so every start (the first and each resume) appends one
entry, and none is ever replaced. `record_start` is called once per start by the training loop
(pretrain/runtime/loop.py, on rank 0, after the stage wrote RUN_DIR/config.yaml), so pretraining, fine-tuning and
detection all record it the same way; `python -m eval baselines` records its own.

    [{"started": "2026-11-28T09:14:03+00:00",   the start's time (UTC)
      "step": 0,                                 the optimizer step it started (0) or resumed at
      "code": {"commit": "9621bbb...",           `git rev-parse HEAD` of the code's checkout; null outside one,
               "dirty": true,                    with "reason"; dirty: tracked changes or untracked files
               "diff_sha256": "5f3e...",         (not ignored by .gitignore); the digest of `git diff HEAD` and the
               "changed_files": ["pretrain/hvs.py", "notes.txt"],   untracked files' contents (null when clean):
               "reason": null},                  two dirty runs at one commit are told apart by it
      "config": {...},                           RUN_DIR/config.yaml as the start wrote it (baselines: its config)
      "packages": {"python": "3.11.9", "torch": "2.13.0", ..., "ffcv": null},   null: not installed
      "machine": {"hostname": ..., "cpu": "AMD EPYC 7B13", "cpu_count": 2, "cpu_affinity": 2,
                  "torch_threads": 2, "gpus": null}}, ...]

`read_code_state` is the one reading of the checkout's state: `eval.results.made_by` (which commit made a table)
uses it too, so a table and the runs it shows mean the same by "uncommitted changes".

It imports nothing outside the runtime; torch only when it describes the machine.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from pretrain.runtime.atomic_write import write_text_atomically

PROVENANCE_FILE = "provenance.json"
CODE_ROOT = Path(__file__).resolve().parents[2]     # the checkout this code runs from
PACKAGES = ("torch", "torchvision", "deepspeed", "timm", "ffcv", "numpy")
GIT_TIMEOUT_S = 30


@dataclass(frozen=True)
class CodeState:
    """The state of a checkout: its commit and whether (and how) its working tree differs from it.

    commit:        `git rev-parse HEAD`; None when it cannot be read, `reason` says why.
    dirty:         tracked files differ from HEAD (staged or not), or there are untracked files that .gitignore
                   does not ignore (a new module is code too); None when `commit` is None.
    diff_sha256:   sha256 of `git diff HEAD` (binary, no renames) and of each untracked file's path and contents:
                   equal for two trees with the same changes, else different. None for a clean tree.
    changed_files: the paths of those changes, tracked then untracked, relative to the checkout's root.
    """

    commit: str | None
    dirty: bool | None = None
    diff_sha256: str | None = None
    changed_files: tuple[str, ...] = ()
    reason: str | None = None

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> CodeState:
        return cls(commit=record.get("commit"), dirty=record.get("dirty"), diff_sha256=record.get("diff_sha256"),
                   changed_files=tuple(record.get("changed_files") or ()), reason=record.get("reason"))

    def to_record(self) -> dict[str, Any]:
        """As provenance.json holds it (`from_record` reads it back)."""
        return {**asdict(self), "changed_files": list(self.changed_files)}

    def label(self) -> str:
        """'9621bbb', '9621bbb+dirty', or 'unknown' (no commit)."""
        if self.commit is None:
            return "unknown"
        return self.commit[:7] + ("+dirty" if self.dirty else "")


class GitError(Exception):
    """git could not answer: not installed, not a checkout, or a command failed (the message says which)."""


def run_git(root: Path, *args: str) -> bytes:
    """The stdout of `git ARGS` in `root`, with the user's diff and colour settings that change its output off."""
    command = ["git", "-c", "color.ui=never", "-c", "diff.noprefix=false", "-c", "core.quotepath=off", *args]
    try:
        done = subprocess.run(command, cwd=root, capture_output=True, timeout=GIT_TIMEOUT_S)
    except FileNotFoundError:
        raise GitError("git is not installed") from None
    except (OSError, subprocess.TimeoutExpired) as error:
        raise GitError(f"git {' '.join(args)} failed in {root}: {error}") from None
    if done.returncode != 0:
        message = done.stderr.decode(errors="replace").strip().splitlines()
        raise GitError(f"git {' '.join(args)} in {root}: {message[0] if message else f'exit {done.returncode}'}")
    return done.stdout


def read_code_state(root: Path = CODE_ROOT) -> CodeState:
    """The state of the git checkout whose top folder is `root` (default: the one this code runs from). Never raises:
    outside a checkout (an installed copy, no git) the commit is None and `reason` says why."""
    root = Path(root).resolve()
    try:
        top = Path(run_git(root, "rev-parse", "--show-toplevel").decode().strip()).resolve()
        if top != root:       # e.g. the package installed in a virtual environment that sits inside a checkout
            return CodeState(None, reason=f"{root} is not the top of a git checkout (it lies inside {top})")
        commit = run_git(root, "rev-parse", "--verify", "HEAD^{commit}").decode().strip()
        tracked = run_git(root, "diff", "HEAD", "--name-only", "--no-renames", "-z").decode().split("\0")
        untracked = run_git(root, "ls-files", "--others", "--exclude-standard", "-z").decode().split("\0")
        tracked, untracked = [path for path in tracked if path], sorted(path for path in untracked if path)
        if not tracked and not untracked:
            return CodeState(commit, dirty=False)
        digest = hashlib.sha256(run_git(root, "diff", "HEAD", "--binary", "--full-index", "--no-renames",
                                        "--no-ext-diff", "--no-textconv"))
        for path in untracked:
            add_file(digest, root, path)
        return CodeState(commit, dirty=True, diff_sha256=digest.hexdigest(),
                         changed_files=tuple(tracked + untracked))
    except GitError as error:
        return CodeState(None, reason=str(error))


def add_file(digest: Any, root: Path, path: str) -> None:
    """Feed an untracked file's path and contents to `digest` (a link: its target; a nested checkout: its name)."""
    digest.update(b"\0untracked\0" + path.encode() + b"\0")
    file = root / path
    if file.is_symlink():
        digest.update(os.readlink(file).encode())
    elif file.is_file():
        with open(file, "rb") as contents:
            for chunk in iter(lambda: contents.read(1 << 20), b""):
                digest.update(chunk)


def package_versions() -> dict[str, str | None]:
    """Python's version and the installed versions of the packages a run's numbers depend on (None: not
    installed)."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def cpu_model_name() -> str | None:
    """The CPU's model name from /proc/cpuinfo (e.g. 'AMD EPYC 7B13'); None where there is none (not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def machine_description() -> dict[str, Any]:
    """Host, CPU model, the machine's cores and those this process may use, torch's threads and the GPUs."""
    import torch  # the runtime imports torch anyway; made_by's readers of the checkout need not

    gpus = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else None
    return {"hostname": socket.gethostname(), "cpu": cpu_model_name(), "cpu_count": os.cpu_count(),
            "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "torch_threads": torch.get_num_threads(), "gpus": gpus}


def read_starts(run_dir: Path) -> list[dict]:
    """The starts RUN_DIR/provenance.json records, oldest first; [] when there is none (a run started before this
    was recorded). An unreadable file raises ValueError naming it."""
    path = Path(run_dir) / PROVENANCE_FILE
    if not path.is_file():
        return []
    try:
        starts = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} cannot be read ({error})") from None
    if not isinstance(starts, list):
        raise ValueError(f"{path} is not a list of starts")
    return starts


def record_start(run_dir: Path, step: int, config: Mapping[str, Any] | None = None,
                 code_root: Path = CODE_ROOT) -> dict:
    """Append this start to RUN_DIR/provenance.json (written whole to a temporary file and renamed: a crash leaves
    the previous list) and return its entry. `step`: the optimizer step the run starts (0) or resumes at; `config`:
    the settings it runs with, by default RUN_DIR/config.yaml as the start wrote it (a training stage's record);
    `code_root`: the checkout whose state is recorded (default: this code's).

    A provenance.json that cannot be read is kept beside it as provenance.json.unreadable (a start is not refused
    for it, and what it held is not overwritten) and the list starts anew."""
    run_dir = Path(run_dir)
    path = run_dir / PROVENANCE_FILE
    try:
        starts = read_starts(run_dir)
    except ValueError as error:
        os.replace(path, path.with_name(PROVENANCE_FILE + ".unreadable"))
        print(f"warning: {error}; kept as {PROVENANCE_FILE}.unreadable, starting a new list", flush=True)
        starts = []
    config_path = run_dir / "config.yaml"
    entry = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "step": int(step),
             "code": read_code_state(code_root).to_record(),
             "config": dict(config) if config is not None else
             yaml.safe_load(config_path.read_text()) if config_path.is_file() else None,
             "packages": package_versions(), "machine": machine_description()}
    write_text_atomically(path, json.dumps([*starts, entry], indent=1) + "\n")
    return entry
