"""Running the project's command lines as a user does, shared by the tests of whole runs (test_pretrain_run,
test_finetune, test_launch_slurm): `run` / `start` a command (forked from a server that imported torch when it
is a single-process `python -m pretrain|eval|...`: tests/forked_runs.py), SIGKILL a process tree as a node
failure would, read a run's metrics, and the hand-computed learning rate of the 2-process digits run."""
import json
import math
import os
import signal
import subprocess
from pathlib import Path

from tests import forked_runs
from tests.machine_speed import scaled

ROOT = Path(__file__).parents[1]


def kill_process_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants at once, as a node failure or `scancel` would (torchrun's
    workers run in sessions of their own, so killing the launcher's group alone leaves them running)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, frontier = [], [pid]
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
    """Run `command` to completion as a user would; a `python -m pretrain|eval ...` of this project runs in a
    process forked from a server that has already imported torch (a second, not 12, to start). `timeout`: seconds
    on the reference CPU, scaled to this machine (tests/machine_speed.py)."""
    project = forked_runs.project_command(command)
    if project is not None:
        return forked_runs.run(*project, expect=expect, timeout=timeout, env=env)
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=scaled(timeout),
                            env={**os.environ, **(env or {})})
    assert result.returncode == expect, result.stderr[-3000:]
    return result


def start(command: list[str]):
    """Start `command` without waiting (forked, as `run`, when it is a single-process project command)."""
    project = forked_runs.project_command(command)
    if project is not None:
        return forked_runs.start(*project)
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def logged(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def hand_computed_lr(step: int) -> float:
    """simclr_digits: lr 0.3 per 256 images, 2 processes x 32 = 64 -> 0.075; 1437 // 2 // 32 = 22 steps per
    epoch, 15 epochs = 330 steps; warm-up 0.5 epochs = 11 steps, linear from 0; then half a cosine to 0."""
    peak, warmup, total = 0.3 * 64 / 256, 11, 330
    if step < warmup:
        return peak * step / warmup
    return 0.5 * peak * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
