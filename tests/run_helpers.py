"""Running the project's command lines as a user does, shared by the tests of whole runs (test_pretrain_run,
test_finetune, test_launch_slurm): `run` / `start` a command (forked from a server that imported torch when it
is a single-process `python -m pretrain|eval|...`: tests/forked_runs.py), SIGKILL a process tree as a node
failure would, read a run's metrics and everything it ended with (compared at zero tolerance by `differences`), give
a run a real full or read-only filesystem (`small_filesystem`, `remount`: the evaluation and writer tests use them
too), and the hand-computed learning rate of the 2-process digits run."""
import contextlib
import json
import math
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import torch

from tests import forked_runs
from tests.machine_speed import scaled

ROOT = Path(__file__).parents[1]


def kill_process_tree(*pids: int) -> None:
    """SIGKILL processes and all their descendants at once, as a node failure or `scancel` would (torchrun's
    workers run in sessions of their own, so killing the launcher's group alone leaves them running). A forked
    run's processes are its `pids` (tests/forked_runs.py: one per rank)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, frontier = [], list(pids)
    while frontier:
        current = frontier.pop()
        tree.append(current)
        frontier += children.get(current, [])
    for member in tree:
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(command: list[str], timeout: int = 300, expect: int = 0, env: dict | None = None):
    """Run `command` to completion as a user would; a `python -m pretrain|eval ...` of this project (or a `torchrun
    ... -m pretrain` of it) runs in processes forked from a server that has already imported torch (a second, not
    12, to start). `timeout`: seconds
    on the reference CPU, scaled to this machine (tests/machine_speed.py)."""
    project = forked_runs.project_command(command)
    if project is not None:
        module, argv, processes = project
        return forked_runs.run(module, argv, expect=expect, timeout=timeout, env=env, processes=processes)
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=scaled(timeout),
                            env={**os.environ, **(env or {})})
    assert result.returncode == expect, result.stderr[-3000:]
    return result


def start(command: list[str]):
    """Start `command` without waiting (forked, as `run`, when it is a project command)."""
    project = forked_runs.project_command(command)
    if project is not None:
        module, argv, processes = project
        return forked_runs.start(module, argv, processes=processes)
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@contextlib.contextmanager
def small_filesystem(mount_point: Path, size: str, read_only: bool = False) -> Iterator[Path]:
    """A real full or read-only filesystem that this test process writes to: a tmpfs of `size` (mount's size=, e.g.
    "64k") at `mount_point`, mounted in the private mount namespace of a sleeping child (nothing leaks out of the
    test), and reached from here through /proc/CHILD/root (yields that path). A command run in-process, or forked
    from the test's server (tests/forked_runs.py), meets the kernel's own ENOSPC / EROFS, without the seconds a new
    interpreter inside the namespace would cost."""
    mount_point.mkdir(parents=True, exist_ok=True)
    read_only_option = f" && mount -o remount,ro {mount_point}" if read_only else ""
    namespace = ["unshare", "--mount", "--propagation", "private"] if os.geteuid() == 0 else \
        ["unshare", "--user", "--map-root-user", "--mount"]
    holder = subprocess.Popen([*namespace, "bash", "-c", f"mount -t tmpfs -o size={size} tmpfs {mount_point}"
                               f"{read_only_option} && echo mounted && exec sleep infinity"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "mounted", "could not mount a tmpfs in a mount namespace"
        yield Path(f"/proc/{holder.pid}/root{mount_point}")
    finally:
        holder.kill()
        holder.wait(timeout=scaled(60))
        holder.stdout.close()


def remount(filesystem: Path, options: str) -> None:
    """Remount a `small_filesystem` (the path it yielded) with mount's `options`: "size=400m" grows a full disk,
    the files on it kept."""
    pid, mount_point = re.fullmatch(r"/proc/(\d+)/root(/.*)", str(filesystem)).groups()
    enter = ["nsenter", "--target", pid, "--mount", *([] if os.geteuid() == 0 else ["--user"])]
    subprocess.run([*enter, "mount", "-o", f"remount,{options}", mount_point], check=True, timeout=scaled(30))


def logged(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# What differs between two runs of the same steps: the clock's values (and every perf/* one), the run's folder
NOT_COMPARED = ("time", "trained_seconds", "run_dir")


def final_state(run_dir: Path, step: int) -> dict:
    """Everything a run ends with at `step`, its last: the checkpoint's files (every .pt loaded, trainer_state.json),
    the backbone export, and the logged values of every step."""
    checkpoint = run_dir / "checkpoints" / f"step{step:08d}"
    state = {path.name: torch.load(path, map_location="cpu", weights_only=False)
             for path in sorted(checkpoint.glob("*.pt"))}
    state["trainer_state.json"] = json.loads((checkpoint / "trainer_state.json").read_text())
    state["backbone.pth"] = torch.load(run_dir / "backbone.pth", map_location="cpu", weights_only=False)
    state["metrics.jsonl"] = logged(run_dir)
    return state


def differences(a, b, where: str = "") -> list[str]:
    """The places where `a` and `b` differ, at zero tolerance (tensors: dtype, shape and every element; NaNs equal),
    NOT_COMPARED skipped."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a.keys() ^ b.keys()))} in one only"]
        return [found for key in a if key not in NOT_COMPARED and not str(key).startswith("perf/")
                for found in differences(a[key], b[key], f"{where}/{key}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items against {len(b)}"]
        return [found for index, (x, y) in enumerate(zip(a, b)) for found in differences(x, y, f"{where}[{index}]")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
        return [] if same else [f"{where}: tensors differ"]
    if type(a) is type(b) and hasattr(a, "__dict__") and type(a).__eq__ is object.__eq__:
        return differences(vars(a), vars(b), where)        # an object without an equality of its own (a loss scaler)
    return [] if type(a) is type(b) and a == b else [f"{where}: {a!r} against {b!r}"]


def hand_computed_lr(step: int) -> float:
    """simclr_digits: lr 0.3 per 256 images, 2 processes x 32 = 64 -> 0.075; 1437 // 2 // 32 = 22 steps per
    epoch, 15 epochs = 330 steps; warm-up 0.5 epochs = 11 steps, linear from 0; then half a cosine to 0."""
    peak, warmup, total = 0.3 * 64 / 256, 11, 330
    if step < warmup:
        return peak * step / warmup
    return 0.5 * peak * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
