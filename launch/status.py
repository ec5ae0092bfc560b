"""`python -m launch status DIR`: for each run under DIR (a run directory, a sweep directory, or any folder of
runs), one row per stage (pretraining, its watcher, the final evaluation, fine-tuning...): the stage's latest job
and that job's state; the run's first row also holds the training step and the latest evaluation.

A job's state comes from Slurm while it knows the job (`squeue`, then `sacct` where accounting is configured),
else from what submitit wrote (its result file: success or error), else from the run directory
(finished.json). A local job is running while its controller process (the job id) is alive.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

from launch.cluster import LaunchError

HELP = "jobs, steps and latest evaluations of a run or a sweep"
DESCRIPTION = ("A table of every run under DIR (a run directory, a sweep directory, or a folder of runs): job, state, "
               "step, latest evaluation.")


def run_directories(root: Path) -> list[Path]:
    """Run directories at or below `root` (those with a jobs.jsonl or a config.yaml), sorted."""
    if (root / "jobs.jsonl").is_file() or (root / "config.yaml").is_file():
        return [root]
    sweep = root / "sweep.json"
    if sweep.is_file():
        return [Path(run["run_dir"]) for run in json.loads(sweep.read_text())["runs"]]
    return sorted({path.parent for pattern in ("*/jobs.jsonl", "*/config.yaml") for path in root.glob(pattern)})


JOB_FIELDS = ("kind", "job_id", "cluster", "folder")       # what every line of jobs.jsonl holds (record_job)


def latest_job_of_each_stage(run_dir: Path) -> list[dict]:
    """The latest job of each stage (jobs.jsonl's `kind`) of the run, in the order the stages were first submitted.
    A line that is not a job's record (a write cut short by a kill or a full disk tears the last line) is skipped
    with a note naming the file and the line: the other jobs are still read."""
    jobs = run_dir / "jobs.jsonl"
    if not jobs.is_file():
        return []
    latest: dict[str, dict] = {}
    for number, line in enumerate(jobs.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            job = json.loads(line)
        except ValueError:
            job = None
        if not isinstance(job, dict) or any(field not in job for field in JOB_FIELDS):
            print(f"note: {jobs} line {number} is not a job's record (a write cut short?), skipped: {line[:60]!r}",
                  file=sys.stderr)
            continue
        latest[job["kind"]] = job
    return list(latest.values())


def job_state(job: dict, run_dir: Path) -> str:
    job_id = job["job_id"]
    if job["cluster"] == "slurm":
        for command in (["squeue", "-h", "-j", job_id, "-o", "%T"],
                        ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"]):
            try:
                shown = subprocess.run(command, capture_output=True, text=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                continue
            state = shown.stdout.strip().splitlines()
            if shown.returncode == 0 and state:
                return state[0].split()[0]
    else:
        try:
            os.kill(int(job_id), 0)
            return "RUNNING"
        except (ProcessLookupError, ValueError, PermissionError):
            pass
    result = Path(job["folder"]) / f"{job_id}_0_result.pkl"
    if result.is_file():
        try:
            outcome, _ = pickle.loads(result.read_bytes())
            return "COMPLETED" if outcome == "success" else "FAILED"
        except Exception:
            pass
    return "COMPLETED" if (run_dir / "finished.json").is_file() else "ENDED (state unknown)"


def training_step(run_dir: Path) -> str:
    finished = run_dir / "finished.json"
    if finished.is_file():
        return f"{json.loads(finished.read_text())['step']} (done)"
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        lines = [line for line in metrics.read_text().splitlines() if line.strip()]
        for line in reversed(lines):
            try:
                record = json.loads(line)
                return f"{record['step']} (epoch {record['epoch']})"
            except (ValueError, KeyError):
                continue
    return "-"


def latest_evaluation(run_dir: Path) -> str:
    results = []
    for path in (run_dir / "eval").glob("*_step*.json"):
        try:
            result = json.loads(path.read_text())
        except ValueError:
            continue
        results.append((result.get("step", -1), path.stem.rsplit("_step", 1)[0], result.get("top1")))
    if not results:
        return "-"
    step = max(r[0] for r in results)
    parts = []
    for _, protocol, top1 in sorted(r for r in results if r[0] == step):
        if isinstance(top1, dict):       # k-NN: one value per k; show k=20 (or the first)
            k, value = ("20", top1["20"]) if "20" in top1 else next(iter(top1.items()))
            parts.append(f"{protocol}@k{k} {100 * value:.2f}%")
        elif isinstance(top1, (int, float)):
            parts.append(f"{protocol} {100 * top1:.2f}%")
        else:
            parts.append(protocol)
    return f"step {step}: " + ", ".join(parts)


def status_table(root: Path) -> str:
    rows = [("run", "job", "state", "step", "latest evaluation")]
    for run_dir in run_directories(root):
        jobs = latest_job_of_each_stage(run_dir) or [None]
        for index, job in enumerate(jobs):
            run_columns = (training_step(run_dir), latest_evaluation(run_dir)) if index == 0 else ("", "")
            rows.append((run_dir.name if index == 0 else "", f"{job['kind']} {job['job_id']}" if job else "-",
                         job_state(job, run_dir) if job else "-", *run_columns))
    if len(rows) == 1:
        return f"no runs under {root} (a run directory holds jobs.jsonl or config.yaml)"
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR")


def run(args: argparse.Namespace) -> int:
    if not Path(args.dir).is_dir():
        raise LaunchError(f"{args.dir}: no such directory; pass a run directory, a sweep directory or a folder of runs")
    print(status_table(Path(args.dir)))
    return 0
