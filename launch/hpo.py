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
import itertools
import json
import math
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import numpy as np

from launch.cluster import ClusterOptions, LaunchError, submit, submit_array
from launch.coordinate_descent import PAPER_DIRECTIONS, coordinate_descent
from launch.jobs import Step
from launch.sweep import run_name
from pretrain.runtime.argument_types import (non_negative_int, number, number_list, output_folder, parse_number,
                                             positive_int)

SEARCH_METHODS = ("cd", "random", "tpe", "cmaes")


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
        from eval.watch import PROTOCOLS

        protocol, _, field = text.partition(":")
        if protocol not in PROTOCOLS or not field:
            raise LaunchError(f"--objective {text!r} is not PROTOCOL:FIELD with a protocol of {PROTOCOLS} (e.g. "
                              "knn:top1.20, linear:top1, retrieval:r_map)")
        return cls(protocol, field)

    def check_arguments(self, eval_args: list[str]) -> None:
        """Refuse extra `python -m eval PROTOCOL` arguments that eval would refuse, before any trial runs."""
        from eval.__main__ import build_parser

        try:
            build_parser().parse_args([self.protocol, "--run", "RUN_DIR", *eval_args])
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
    from pretrain.config import load_config

    value = load_config(config, overrides)
    for part in key.split("."):
        if not hasattr(value, part):
            raise LaunchError(f"{key}: the config has no such key (see pretrain/config.py)")
        value = getattr(value, part)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LaunchError(f"{option} {key}: the config's {key} is {value!r}, not a number; {option} searches numeric "
                          "keys (to compare values of another kind, use `launch pretrain --sweep`)")
    return value


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
        from launch.status import job_state

        return job_state(self.record, self.run_dir) not in ACTIVE_STATES

    def exception(self) -> None:
        return None


def still_running(run_dir: Path, kind: str = "trial") -> SubmittedBefore | None:
    """The run's last job of this kind (jobs.jsonl's), when it is still pending or running."""
    from launch.status import job_state, latest_job_of_each_stage

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
        from pretrain.config import load_config

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


# ============ python -m launch grid ============

def grid_axis(text: str, factor: float) -> tuple[str, list[float]]:
    """`KEY=V1,V2,...`, or `KEY=LOW:HIGH`: LOW, LOW x factor, ... up to HIGH (the paper: steps of 2; `factor` > 1,
    checked by --factor's type). The values are finite, positive and increasing: a grid is searched in log space."""
    key, _, values = text.partition("=")
    parts = values.split(":") if ":" in values else [v for v in values.split(",") if v.strip()]
    if not key or not parts or (":" in values and len(parts) != 2):
        raise LaunchError(f"--axis {text!r} is not KEY=LOW:HIGH or KEY=V1,V2,... (e.g. --axis method.lambda_p=0.0625:4 "
                          "or --axis optim.lr=0.1,0.2,0.4)")
    try:
        points = [parse_number(part.strip(), float, above=0) for part in parts]
    except ValueError as error:
        raise LaunchError(f"--axis {text!r}: {error}") from None
    if ":" in values:
        low, high = points
        count = int(math.floor(math.log(high / low) / math.log(factor) + 1e-9)) + 1 if low <= high else 0
        points = [low * factor ** i for i in range(count)]
    if not points or sorted(set(points)) != points:
        raise LaunchError(f"--axis {text!r}: a grid's values must be positive, increasing (V1 < V2 < ..., or LOW "
                          "below HIGH)")
    return key, points


def run_grid(args: argparse.Namespace, trial_jobs: type[TrialJobs] = TrialJobs) -> int:
    from launch.cluster import cluster_options
    from launch.hpo_replay import Grid, format_table

    options = cluster_options(args)
    objective = Objective.parse(args.objective)
    objective.check_arguments(args.eval_args)
    axes = dict(grid_axis(text, args.factor) for text in args.axis)
    if len(axes) != len(args.axis):
        raise LaunchError(f"--axis names a key twice: {args.axis}")
    integer_keys = {key for key in axes if isinstance(config_value(args.config, args.overrides, key, "--axis"), int)}
    search_dir = Path(args.out_dir).resolve()
    jobs = trial_jobs(options, search_dir, args.config, args.overrides, objective, args.eval_args, args.parallel,
                      args.keep_checkpoints)
    points = list(itertools.product(*(range(len(values)) for values in axes.values())))
    values = np.full([len(v) for v in axes.values()], np.nan)

    def trials():
        for index in points:
            point = {key: axis[i] for (key, axis), i in zip(axes.items(), index)}
            overrides = assignments(point, integer_keys)
            yield index, run_name("point", overrides), overrides

    for _, name, overrides in trials():             # every point's config, before any job is submitted
        jobs.check_trial(name, overrides, "--axis")

    def finished(index, value):
        values[index] = np.nan if value is None else value
        print(f"grid: {int(np.sum(~np.isnan(values)))}/{values.size} points measured", flush=True)

    jobs.run(trials(), finished, as_array=True)
    metric = f"{objective.protocol} {objective.field}"
    print(f"\n{metric} over {' x '.join(axes)}")
    rows = [{**{key: f"{axis[i]:.6g}" for (key, axis), i in zip(axes.items(), index)},
             "value": None if np.isnan(values[index]) else float(values[index])} for index in points]
    print(format_table(rows, [*axes, "value"]))
    missing = int(np.isnan(values).sum())
    if missing:
        print(f"{missing} of {values.size} points failed (their logs are named above); run the same command again "
              f"to retry them: the finished points are kept")
        return 1
    Grid(list(axes), list(axes.values()), values, metric).save(search_dir / "grid.json")
    print(f"grid: {search_dir / 'grid.json'}; replay searches on it: python -m launch hpo-replay --grid "
          f"{search_dir / 'grid.json'} --out-dir DIR")
    return 0


# ============ python -m launch hpo ============

def sampler(method: str, seed: int):
    """Optuna's sampler, with its defaults (optuna 5.0.0: TPE multivariate with 10 random start-up trials and the
    constant liar for parallel trials; CMA-ES from the box's centre with sigma0 = a sixth of its smallest side)."""
    import optuna

    return {"random": optuna.samplers.RandomSampler, "tpe": optuna.samplers.TPESampler,
            "cmaes": optuna.samplers.CmaEsSampler}[method](seed=seed)


def search_settings(args: argparse.Namespace, space: list[SearchKey]) -> dict:
    return {"config": args.config, "overrides": args.overrides, "space": [asdict(key) for key in space],
            "objective": args.objective, "method": args.method, "eval_args": args.eval_args, "seed": args.seed,
            "directions": args.directions, "budgets": args.budgets, "start": args.start}


def check_same_search(search_dir: Path, settings: dict) -> None:
    """A search directory holds one search: started again, its settings must be the same (or it is refused,
    naming what changed: the finished trials would mean something else)."""
    saved_path = search_dir / "search.json"
    if saved_path.is_file():
        saved = json.loads(saved_path.read_text())
        changed = [key for key in settings if saved.get(key) != settings[key]]
        if changed:
            raise LaunchError(f"{search_dir} holds a search with other settings ({', '.join(changed)}: "
                              f"{', '.join(f'{saved.get(k)!r} there' for k in changed)}): pass another --out-dir, "
                              "or the same settings to resume it")
    search_dir.mkdir(parents=True, exist_ok=True)
    saved_path.write_text(json.dumps(settings, indent=1) + "\n")


def run_search(args: argparse.Namespace, trial_jobs: type[TrialJobs] = TrialJobs) -> int:
    import optuna

    from launch.cluster import cluster_options

    options = cluster_options(args)
    objective = Objective.parse(args.objective)
    objective.check_arguments(args.eval_args)
    space = [SearchKey.parse(text) for text in args.space]
    if len({key.key for key in space}) != len(space):
        raise LaunchError(f"--space names a key twice: {args.space}")
    integer_keys = {key.key for key in space
                    if isinstance(config_value(args.config, args.overrides, key.key, "--space"), int)}
    search_dir = Path(args.out_dir).resolve()
    jobs = trial_jobs(options, search_dir, args.config, args.overrides, objective, args.eval_args,
                      1 if args.method == "cd" else args.parallel, args.keep_checkpoints)
    for corner in ("low", "high"):                  # the box's corners: a value the config refuses, named now
        jobs.check_trial(f"trial_{corner}", assignments({key.key: getattr(key, corner) for key in space},
                                                        integer_keys), "--space")
    descent = coordinate_descent_setup(args, space) if args.method == "cd" else None
    # Every argument is checked: only now is anything written (a refused command must leave no search behind).
    check_same_search(search_dir, search_settings(args, space))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = f"sqlite:///{search_dir / 'study.db'}"
    # A resumed search's sampler is seeded past its finished trials: it must not draw the first trials' points again.
    resumed = len(optuna.load_study(study_name="search", storage=storage).trials) \
        if (search_dir / "study.db").is_file() else 0
    study = optuna.create_study(storage=storage, study_name="search", direction="maximize", load_if_exists=True,
                                sampler=sampler("random" if args.method == "cd" else args.method, args.seed + resumed))
    distributions = {key.key: optuna.distributions.FloatDistribution(key.low, key.high, log=key.log) for key in space}

    def overrides_of(params: dict) -> list[str]:
        return assignments({key.key: params[key.key] for key in space}, integer_keys)

    def finished(trial_number: int, value: float | None):
        if value is None:
            study.tell(trial_number, state=optuna.trial.TrialState.FAIL)
        else:
            study.tell(trial_number, value)
        report_progress(study, args.trials)

    unfinished = [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
    if unfinished:                       # a killed search: its running trials' jobs are submitted again (they resume)
        print(f"resuming {len(unfinished)} trial(s) that were running when the search stopped", flush=True)
        jobs.run(((t.number, f"trial{t.number:04d}", overrides_of(t.params)) for t in unfinished), finished)

    if args.method == "cd":
        run_coordinate_descent(args, space, descent, study, distributions, jobs, overrides_of, finished)
    else:
        def next_trials():
            while len(study.trials) < args.trials:
                trial = study.ask(distributions)
                yield trial.number, f"trial{trial.number:04d}", overrides_of(trial.params)
        jobs.run(next_trials(), finished)
    if not any(trial.state == optuna.trial.TrialState.COMPLETE for trial in study.trials):
        # a table of failures, and a best-so-far plot of nothing, would read as a finished search
        failed = len(study.trials)
        print(f"error: every trial of the search failed ({failed} of {failed}): their logs are {search_dir}/trials/*/"
              "jobs/*_log.err (each named above); no results are written. Fix the cause, then start the search again "
              "with another --out-dir", file=sys.stderr)
        return 1
    write_search_results(study, space, objective, search_dir, args.method)
    return 0


def coordinate_descent_setup(args: argparse.Namespace,
                             space: list[SearchKey]) -> tuple[np.ndarray, list[int], list[float]]:
    """cd's directions, trials per line search and starting point (in search coordinates), checked against the
    space before the search writes anything."""
    dimensions = len(space)
    if args.directions == "paper":
        if dimensions not in (2, 3):
            raise LaunchError(f"--directions paper needs 2 or 3 keys (Lambda_p, Lambda_e[, batch size]), got "
                              f"{dimensions}; use --directions identity")
        directions = PAPER_DIRECTIONS[:dimensions, :dimensions]
    else:
        directions = np.eye(dimensions)
    budgets = args.budgets or [3] * dimensions
    # the start: the config's own values by default; clipped into the box below
    start_values = args.start or [float(config_value(args.config, args.overrides, key.key, "--space"))
                                  for key in space]
    for option, values in (("--budgets", budgets), ("--start", start_values)):
        if len(values) != dimensions:
            raise LaunchError(f"{option} {','.join(f'{v:g}' for v in values)} needs one value per --space key "
                              f"({dimensions})")
    start = [key.to_search(min(max(v, key.low), key.high)) for key, v in zip(space, start_values)]
    return directions, budgets, start


def run_coordinate_descent(args, space, descent, study, distributions, jobs, overrides_of, finished) -> None:
    """Algorithm 1 with each evaluation a trial of the study, in order: a resumed search walks the same path, its
    finished trials read back from the study (the path is deterministic given the values). `descent`: the
    directions, budgets and start of coordinate_descent_setup."""
    import optuna

    directions, budgets, start = descent
    evaluations = itertools.count()

    def evaluate(point: np.ndarray) -> float:
        number = next(evaluations)
        params = {key.key: key.from_search(x) for key, x in zip(space, point)}
        trials = study.trials
        if number < len(trials):                   # walked before this search was stopped
            trial = trials[number]
            if not all(math.isclose(trial.params[k], v, rel_tol=1e-9) for k, v in params.items()):
                raise LaunchError(f"trial {number} of the study in {jobs.search_dir} was at {trial.params}, "
                                  f"coordinate descent now asks for {params}: the study is not this search's")
            if trial.state == optuna.trial.TrialState.COMPLETE:
                return trial.value
            if trial.state == optuna.trial.TrialState.FAIL:
                return -math.inf
        else:
            study.enqueue_trial(params)
            trial = study.ask(distributions)
        value = {}
        jobs.run(iter([(trial.number, f"trial{trial.number:04d}", overrides_of(params))]),
                 lambda number, v: (value.setdefault("v", v), finished(number, v)))
        return -math.inf if value["v"] is None else value["v"]   # a failed run is the worst point

    coordinate_descent(evaluate, start, [k.to_search(k.low) for k in space], [k.to_search(k.high) for k in space],
                       directions, budgets, args.trials)


def report_progress(study, budget: int) -> None:
    import optuna

    done = [t for t in study.trials if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)]
    complete = [t for t in done if t.state == optuna.trial.TrialState.COMPLETE]
    best = f"best {study.best_value:.4f} (trial {study.best_trial.number}: {format_params(study.best_params)})" \
        if complete else "no trial finished yet"
    print(f"hpo: {len(done)}/{budget} trials done; {best}", flush=True)


def format_params(params: dict) -> str:
    return ", ".join(f"{key}={value:.4g}" for key, value in params.items())


def write_search_results(study, space: list[SearchKey], objective: Objective, search_dir: Path, method: str) -> None:
    """The table of trials (printed and SEARCH_DIR/trials.json) and the plot of the best value against the number
    of trials (SEARCH_DIR/best_so_far.png)."""
    import optuna

    from launch.hpo_replay import format_table

    rows, best = [], -math.inf
    for trial in sorted(study.trials, key=lambda t: t.number):
        if trial.state not in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL):
            continue
        value = trial.value if trial.state == optuna.trial.TrialState.COMPLETE else None
        best = max(best, value if value is not None else -math.inf)
        rows.append({"trial": trial.number, **{key.key: f"{trial.params[key.key]:.4g}" for key in space},
                     "value": value, "best so far": best if best > -math.inf else None})
    print(f"\n{method}: {objective.protocol} {objective.field}")
    print(format_table(rows, ["trial", *(key.key for key in space), "value", "best so far"]))
    (search_dir / "trials.json").write_text(json.dumps(rows, indent=1) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    curve = [(i + 1, row["best so far"]) for i, row in enumerate(rows) if row["best so far"] is not None]
    if curve:
        axes.step(*zip(*curve), where="post", label=method)
    axes.set_xlabel("trials")
    axes.set_ylabel(f"best so far ({objective.protocol} {objective.field})")
    axes.legend()
    figure.tight_layout()
    figure.savefig(search_dir / "best_so_far.png", dpi=120)
    plt.close(figure)
    print(f"results: {search_dir / 'trials.json'}, {search_dir / 'best_so_far.png'}; the study: "
          f"sqlite:///{search_dir / 'study.db'} (optuna-dashboard opens it)")


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


def add_grid_arguments(parser: argparse.ArgumentParser) -> None:
    add_trial_arguments(parser)
    parser.add_argument("--axis", action="append", required=True, metavar="KEY=LOW:HIGH",
                        help="a grid axis: KEY=LOW:HIGH in multiplicative steps of --factor, or KEY=V1,V2,...; "
                             "once per key")
    parser.add_argument("--factor", type=number(float, above=1), default=2.0,
                        help="the multiplicative step of KEY=LOW:HIGH axes (default: %(default)s, the paper's)")


def add_search_arguments(parser: argparse.ArgumentParser) -> None:
    add_trial_arguments(parser)
    parser.add_argument("--space", action="append", required=True, metavar="KEY=LOW:HIGH[:log]",
                        help="a searched key and its range, on a log scale with :log; once per key (for cd with the "
                             "paper's directions: Lambda_p's key, then Lambda_e's[, then the batch size's])")
    parser.add_argument("--method", choices=SEARCH_METHODS, default="cd",
                        help="cd: the paper's coordinate descent; random, tpe, cmaes: Optuna's samplers "
                             "(default: %(default)s)")
    parser.add_argument("--trials", type=positive_int, default=20,
                        help="the search's budget of trials (default: %(default)s)")
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="the Optuna sampler's seed (default: %(default)s)")
    parser.add_argument("--directions", choices=("paper", "identity"), default="paper",
                        help="cd's search directions: the paper's A (balance, joint learning rate[, batch size]) or "
                             "the keys one at a time (default: %(default)s)")
    parser.add_argument("--budgets", type=number_list(int, at_least=1),
                        help="cd's trials per line search along each direction, e.g. 3,3 (default: 3 each)")
    parser.add_argument("--start", type=number_list(float),
                        help="cd's starting point, one value per --space key (default: the config's values)")
