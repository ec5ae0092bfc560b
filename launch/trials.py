"""Hyper-parameter search whose trials are `launch` jobs: `python -m launch grid` measures the objective on a grid,
`python -m launch hpo` searches (the balance paper's coordinate descent, or Optuna's random search, TPE, CMA-ES).

A trial is one job (Slurm, or a local process; `--cluster` and the other cluster flags as for `launch pretrain`):

    python -m pretrain --config CONFIG OVERRIDES KEY=VALUE ... run_dir=SEARCH_DIR/trials/NAME
    python -m eval PROTOCOL --run SEARCH_DIR/trials/NAME EVAL_ARGS

and its value is a field of the evaluation's JSON, `--objective PROTOCOL:FIELD` (`knn:top1.20`, the k-NN top-1 at
k = 20; `retrieval:r_map`). At most `--parallel` trials run at once (a grid on Slurm: one job array). Started again
with the same command, a stopped grid or search goes on: a trial whose result JSON exists is read, not run; one whose
job still runs (jobs outlive the command that submitted them) is waited for; one whose job was killed is submitted
again and resumes from its checkpoint. `hpo` keeps its trials in an Optuna study (SEARCH_DIR/study.db, SQLite):
`optuna-dashboard sqlite:///SEARCH_DIR/study.db` and Optuna's plots open it. Coordinate descent runs one trial at a
time (each line search step depends on the one before); Optuna's samplers run `--parallel` at once.

    space = [SearchKey.parse("method.lambda_p=0.0625:4:log"), SearchKey.parse("method.lambda_e=0.0625:4:log")]
    objective = Objective.parse("knn:top1.20")
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

from omegaconf import OmegaConf

from launch.cluster import ClusterOptions, LaunchError, submit, submit_array
from launch.jobs import Step
from launch.status import job_state, latest_job_of_each_stage
from pretrain.config import load_config
from pretrain.runtime.argument_types import output_folder, positive_int


# ============ what is searched and what is measured ============

@dataclass(frozen=True)
class SearchKey:
    """A config key searched between `low` and `high`, on a log scale (`log`) or a linear one."""

    key: str
    low: float
    high: float
    log: bool

    @classmethod
    def parse(cls, text: str) -> "SearchKey":
        """`KEY=LOW:HIGH` (linear) or `KEY=LOW:HIGH:log`."""
        match = re.fullmatch(r"([A-Za-z_][\w.]*)=([^:]+):([^:]+)(?::(log|linear))?", text.strip())
        try:
            key, low, high, scale = match.group(1), float(match.group(2)), float(match.group(3)), match.group(4)
        except (AttributeError, ValueError):
            raise LaunchError(f"--space {text!r} is not KEY=LOW:HIGH[:log] (e.g. --space method.lambda_p=0.0625:4:log)"
                              ) from None
        log = scale == "log"
        if not low < high or (log and low <= 0):
            raise LaunchError(f"--space {text!r}: LOW must be below HIGH, and positive on a log scale")
        return cls(key, low, high, log)

    def to_search(self, value: float) -> float:
        """The coordinate the search moves in: log(value) on a log scale."""
        return math.log(value) if self.log else value

    def from_search(self, coordinate: float) -> float:
        value = math.exp(coordinate) if self.log else coordinate
        return min(max(value, self.low), self.high)          # exp(log(x)) may leave the box by a rounding error


@dataclass(frozen=True)
class Objective:
    """`PROTOCOL:FIELD`: the evaluation a trial ends with (`python -m eval PROTOCOL`) and the field of its JSON
    (dots go into nested fields: `top1.20`) that is maximised."""

    protocol: str
    field: str

    @classmethod
    def parse(cls, text: str) -> "Objective":
        from eval.watch import PROTOCOLS    # eval brings timm and deepspeed: imported when an objective is read

        protocol, _, field = text.partition(":")
        if protocol not in PROTOCOLS or not field:
            raise LaunchError(f"--objective {text!r} is not PROTOCOL:FIELD with a protocol of {PROTOCOLS} (e.g. "
                              "knn:top1.20, linear:top1, retrieval:r_map)")
        return cls(protocol, field)

    def check_arguments(self, eval_args: list[str]) -> None:
        """Refuse extra `python -m eval PROTOCOL` arguments that eval would refuse, before any trial runs."""
        from eval.watch import parse_protocol_arguments     # as in `parse`

        try:
            parse_protocol_arguments(self.protocol, ["--run", "RUN_DIR", *eval_args])
        except SystemExit:
            raise LaunchError(f"--eval-args {' '.join(eval_args)!r}: `python -m eval {self.protocol}` does not take "
                              f"them (see python -m eval {self.protocol} --help)") from None

    def read(self, run_dir: Path) -> float | None:
        """The value in the newest RUN_DIR/eval/PROTOCOL_step*.json; None before there is one."""
        results = sorted((run_dir / "eval").glob(f"{self.protocol}_step*.json"))
        if not results:
            return None
        value = json.loads(results[-1].read_text())
        for part in self.field.split("."):
            if not isinstance(value, dict) or part not in value:
                fields = sorted(value) if isinstance(value, dict) else []
                raise LaunchError(f"--objective {self.protocol}:{self.field}: {results[-1]} has no {part!r}; its "
                                  f"fields here: {', '.join(fields)}")
            value = value[part]
        return float(value)


def config_value(config: str | None, overrides: list[str], key: str, option: str) -> int | float:
    """The value of a dotted config key in the config (with overrides), to know its type and starting value; a key
    that is not a number (`method.name`) is refused naming `option`: a search moves numbers."""
    missing = object()
    value = OmegaConf.select(load_config(config, overrides), key, default=missing)      # data.views.0.scale.0 too
    if value is missing:
        raise LaunchError(f"{key}: the config has no such key (see pretrain/config.py)")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LaunchError(f"{option} {key}: the config's {key} is {value!r}, not a number; {option} searches numeric "
                          "keys (to compare values of another kind, use `launch pretrain --sweep`)")
    return value


def read_lines(path: Path) -> list[dict]:
    """The lines of a JSON-lines file (a run's metrics.jsonl), none when it does not exist yet."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def training_minutes(run_dir: Path) -> float | None:
    """A trial's minutes of training, what it cost: its run's training clock (`perf/training_seconds`, the last one
    metrics.jsonl logged; counted across resumes), None before it logged one."""
    clock = [line["perf/training_seconds"] for line in read_lines(run_dir / "metrics.jsonl")
             if "perf/training_seconds" in line]
    return clock[-1] / 60 if clock else None


def search_cost(minutes: list[float | None]) -> str:
    """The line under a search's table: its trials and their minutes of training in all."""
    known = [m for m in minutes if m is not None]
    return (f"cost: {len(minutes)} trials, {sum(known):.1f} minutes of training in all (their evaluations not "
            f"counted{'' if len(known) == len(minutes) else f'; {len(minutes) - len(known)} logged no minutes'})")


def assignments(values: dict[str, float], integer_keys: set[str]) -> list[str]:
    """Config overrides for one trial: `key=value`, integer keys (a batch size) rounded."""
    return [f"{key}={round(value) if key in integer_keys else f'{value:.6g}'}" for key, value in values.items()]


# ============ running trials as jobs ============

ACTIVE_STATES = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "RESIZING",
                 "SUSPENDED")


@dataclass
class SubmittedBefore:
    """A trial's job that a stopped search submitted and that still runs (Slurm jobs outlive the search, and so do
    local ones): waited for, not submitted again. Its outcome is the result JSON it writes, or none."""

    record: dict              # its line of RUN_DIR/jobs.jsonl
    run_dir: Path

    @property
    def job_id(self) -> str:
        return self.record["job_id"]

    @property
    def paths(self) -> SimpleNamespace:
        return SimpleNamespace(stderr=self.record.get("stderr"))

    def done(self) -> bool:
        return job_state(self.record, self.run_dir) not in ACTIVE_STATES

    def exception(self) -> None:
        return None


def still_running(run_dir: Path, kind: str = "trial") -> SubmittedBefore | None:
    """The run's last job of this kind (jobs.jsonl's), when it is still pending or running."""
    for record in latest_job_of_each_stage(run_dir):
        if record["kind"] == kind and job_state(record, run_dir) in ACTIVE_STATES:
            return SubmittedBefore(record, run_dir)
    return None


@dataclass
class TrialJobs:
    """Runs trials as launch jobs, at most `parallel` at once, each in SEARCH_DIR/trials/NAME. `kind` names them in
    jobs.jsonl and in the messages (a benchmark's rows are `row`: launch/benchmark.py)."""

    options: ClusterOptions
    search_dir: Path
    config: str | None
    overrides: list[str]
    objective: Objective
    eval_args: list[str]
    parallel: int = 1
    keep_checkpoints: bool = False
    poll_seconds: ClassVar[float] = 1.0          # how often running jobs are checked
    kind: ClassVar[str] = "trial"

    def run_dir(self, name: str) -> Path:
        return self.search_dir / "trials" / name

    def pretrain_overrides(self, name: str, trial_overrides: list[str]) -> list[str]:
        """The config overrides of the trial's pretraining."""
        return [*self.overrides, *trial_overrides, f"name={name}", f"run_dir={self.run_dir(name)}"]

    def steps(self, name: str, trial_overrides: list[str]) -> list[Step]:
        run_dir = self.run_dir(name)
        config = ["--config", str(Path(self.config).resolve())] if self.config else []
        return [Step("pretrain", [*config, *self.pretrain_overrides(name, trial_overrides)]),
                Step("eval", [self.objective.protocol, "--run", str(run_dir), *self.eval_args], distributed=False)]

    def check_trial(self, name: str, trial_overrides: list[str], option: str) -> None:
        """Load the config the trial's pretraining would, so that a value the config refuses (`optim.name=1`, a
        crop fraction above 1) is named, with the `option` that gave it, before any job is submitted."""
        try:
            load_config(self.config, self.pretrain_overrides(name, trial_overrides))
        except ValueError as error:
            raise LaunchError(f"{option} gives a trial {' '.join(trial_overrides)}, which the config refuses: "
                              f"{error}") from None

    def tidy(self, run_dir: Path) -> None:
        """A measured trial keeps its result, config, metrics, logs and final export (backbone.pth); its checkpoints,
        exports and feature cache go (about 0.6 GB a digits trial: a 49-point grid kept 30 GB), unless
        --keep-checkpoints."""
        if self.keep_checkpoints:
            return
        for folder in ("checkpoints", "exports"):
            shutil.rmtree(run_dir / folder, ignore_errors=True)
        for cache in (run_dir / "eval").glob("features_step*.pt"):
            cache.unlink(missing_ok=True)

    def submit_trial(self, name: str, trial_overrides: list[str]):
        """Submit one trial's job (a submitit job: done(), exception(), paths.stderr)."""
        job = submit(self.options, self.run_dir(name), self.kind, self.steps(name, trial_overrides), announce=False)
        print(f"{self.kind} {name}: job {job.job_id} ({self.options.cluster}), log {job.paths.stderr}", flush=True)
        return job

    def submit_array(self, trials: list[tuple[object, str, list[str]]]) -> list:
        """Submit trials known in advance (a grid's points) as one Slurm job array, `parallel` running at once."""
        jobs = submit_array(self.options, self.search_dir / "jobs", self.search_dir.name, self.kind,
                            [(self.run_dir(name), self.steps(name, overrides)) for _, name, overrides in trials],
                            parallel=self.parallel, announce=False)
        for (_, name, _), job in zip(trials, jobs):
            print(f"{self.kind} {name}: job {job.job_id} (slurm array), log {job.paths.stderr}", flush=True)
        return jobs

    def run(self, trials: Iterator[tuple[object, str, list[str]]],
            finished: Callable[[object, float | None], None], as_array: bool = False) -> None:
        """Run every (tag, name, overrides) the iterator yields, `parallel` at a time, calling finished(tag, value)
        for each (value None: the job failed). The iterator is advanced only when a job slot is free, so what it
        yields may depend on the trials finished before. `as_array`: on Slurm, submit them all at once as one job
        array (Slurm keeps `parallel` running); locally, as without it."""
        running: dict[object, tuple[object, Path, object]] = {}

        def done(tag, run_dir: Path, value: float | None) -> None:
            if value is not None:
                self.tidy(run_dir)
            finished(tag, value)

        def measured_before(tag, name) -> bool:
            """A resumed search's trial: finished (read, not run again), or its job still running (waited for)."""
            value = self.objective.read(self.run_dir(name))
            if value is not None:
                done(tag, self.run_dir(name), value)
                return True
            job = still_running(self.run_dir(name), self.kind)
            if job is not None:
                print(f"{self.kind} {name}: its job {job.job_id} from before is still running; waiting for it",
                      flush=True)
                running[job.job_id] = (tag, self.run_dir(name), job)
            return job is not None

        if as_array and self.options.cluster == "slurm":
            todo = [(tag, name, overrides) for tag, name, overrides in trials if not measured_before(tag, name)]
            if todo:
                for (tag, name, _), job in zip(todo, self.submit_array(todo)):
                    running[job.job_id] = (tag, self.run_dir(name), job)
            trials = iter(())
        exhausted = False
        while True:
            while not exhausted and len(running) < self.parallel:
                item = next(trials, None)
                if item is None:
                    exhausted = True
                    break
                tag, name, trial_overrides = item
                if not measured_before(tag, name):
                    job = self.submit_trial(name, trial_overrides)
                    running[job.job_id] = (tag, self.run_dir(name), job)
            if not running:
                return
            if not any(job.done() for *_, job in running.values()):
                time.sleep(self.poll_seconds)
            for job_id, (tag, run_dir, job) in list(running.items()):
                if job.done():
                    del running[job_id]
                    value = self.objective.read(run_dir) if job.exception() is None else None
                    print(f"{self.kind} {run_dir.name} failed: see {job.paths.stderr}" if value is None else
                          f"{self.kind} {run_dir.name}: {self.objective.protocol} {self.objective.field} = "
                          f"{value:.4f}", flush=True)
                    done(tag, run_dir, value)


# ============ arguments ============

def add_trial_arguments(parser: argparse.ArgumentParser) -> None:
    """What every trial runs: the config, its overrides, the objective, the evaluation's extra arguments."""
    parser.add_argument("--config", help="pretraining config (configs/pretrain/*.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides of every trial")
    parser.add_argument("--objective", default="knn:top1.20",
                        help="PROTOCOL:FIELD of the evaluation JSON to maximise (default: %(default)s; e.g. "
                             "retrieval:r_map)")
    parser.add_argument("--eval-args", default="", type=lambda text: text.split(),
                        help="extra arguments of `python -m eval PROTOCOL`, as one string (e.g. "
                             "--eval-args=--split-classes)")
    parser.add_argument("--parallel", type=positive_int, default=1,
                        help="trials running at once (default: %(default)s)")
    parser.add_argument("--out-dir", required=True, type=output_folder,
                        help="the search's directory: trials/, results, and the study")
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="keep each measured trial's checkpoints and exports (default: removed once its result "
                             "exists; its final backbone.pth, config, metrics and logs stay)")
