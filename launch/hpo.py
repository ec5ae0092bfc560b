"""`python -m launch hpo`: a hyper-parameter search whose trials are jobs (launch/trials.py), kept in an Optuna study
(SEARCH_DIR/study.db) that a restarted search resumes: the balance paper's coordinate descent
(launch/coordinate_descent.py, one trial at a time), or Optuna's random search, TPE and CMA-ES (--parallel at once).
At the end: the table of trials (SEARCH_DIR/trials.json) and the best value against the number of trials
(SEARCH_DIR/best_so_far.png)."""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

import launch.trials
from launch.cluster import LaunchError, add_cluster_arguments, cluster_options
from launch.coordinate_descent import PAPER_DIRECTIONS, coordinate_descent
from launch.hpo_replay import format_table
from launch.trials import (Objective, SearchKey, TrialJobs, add_trial_arguments, assignments, config_value,
                           search_cost, training_minutes)
from pretrain.runtime.argument_types import non_negative_int, number_list, positive_int

HELP = "a hyper-parameter search whose trials are jobs (cd, random, tpe, cmaes)"
DESCRIPTION = launch.trials.__doc__
EPILOG = ("example:\n  python -m launch hpo --config configs/pretrain/simclr_digits.yaml --space "
          "method.lambda_p=0.0625:4:log --space method.lambda_e=0.0625:4:log --method cd --trials 20 --cluster local "
          "--out-dir runs/hpo_simclr_cd")
SEARCH_METHODS = ("cd", "random", "tpe", "cmaes")


def sampler(method: str, seed: int):
    """Optuna's sampler, with its defaults (optuna 5.0.0: TPE multivariate with 10 random start-up trials and the
    constant liar for parallel trials; CMA-ES from the box's centre with sigma0 = a sixth of its smallest side)."""
    import optuna  # as in `run`

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


def run(args: argparse.Namespace, trial_jobs: type[TrialJobs] = TrialJobs) -> int:
    import optuna  # seconds to import: only the search pays for it, not every launch command

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
    import optuna  # as in `run`

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
    import optuna  # as in `run`

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
    import matplotlib  # as optuna in `run`: only the search pays for it
    import optuna

    rows, best = [], -math.inf
    for trial in sorted(study.trials, key=lambda t: t.number):
        if trial.state not in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL):
            continue
        value = trial.value if trial.state == optuna.trial.TrialState.COMPLETE else None
        best = max(best, value if value is not None else -math.inf)
        minutes = training_minutes(search_dir / "trials" / f"trial{trial.number:04d}")
        rows.append({"trial": trial.number, **{key.key: f"{trial.params[key.key]:.4g}" for key in space},
                     "value": value, "best so far": best if best > -math.inf else None,
                     "minutes": None if minutes is None else round(minutes, 2)})
    print(f"\n{method}: {objective.protocol} {objective.field}")
    print(format_table(rows, ["trial", *(key.key for key in space), "value", "best so far", "minutes"]))
    print(search_cost([row["minutes"] for row in rows]))
    (search_dir / "trials.json").write_text(json.dumps(rows, indent=1) + "\n")
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

def add_arguments(parser: argparse.ArgumentParser) -> None:
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
    add_cluster_arguments(parser)
