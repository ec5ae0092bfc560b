"""`python -m launch grid`: the objective measured at every point of a grid of config values, each point a trial
(launch/trials.py: a job, at most --parallel at once; on Slurm one job array); SEARCH_DIR/grid.json is what
`python -m launch hpo-replay` reads."""
from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

import numpy as np

import launch.trials
from launch.cluster import LaunchError, add_cluster_arguments, cluster_options
from launch.hpo_replay import Grid, format_table
from launch.sweep import run_name
from launch.trials import (Objective, TrialJobs, add_trial_arguments, assignments, config_value, search_cost,
                           training_minutes)
from pretrain.runtime.argument_types import number, parse_number

HELP = "the objective measured on a grid of config values, as a sweep of jobs"
DESCRIPTION = launch.trials.__doc__ + ("\n`grid`: every point of the product of the --axis values is a trial; "
                                       "SEARCH_DIR/grid.json is what `hpo-replay` reads.")
EPILOG = ("example:\n  python -m launch grid --config configs/pretrain/simclr_digits.yaml --axis "
          "method.lambda_p=0.0625:4 --axis method.lambda_e=0.0625:4 --objective knn:top1.20 --cluster local "
          "--out-dir runs/grid_simclr")


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


def run(args: argparse.Namespace, trial_jobs: type[TrialJobs] = TrialJobs) -> int:
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
    rows = []
    for index, name, _ in trials():
        minutes = training_minutes(jobs.run_dir(name))
        rows.append({**{key: f"{axis[i]:.6g}" for (key, axis), i in zip(axes.items(), index)},
                     "value": None if np.isnan(values[index]) else float(values[index]),
                     "minutes": None if minutes is None else round(minutes, 2)})
    print(format_table(rows, [*axes, "value", "minutes"]))
    print(search_cost([row["minutes"] for row in rows]))
    missing = int(np.isnan(values).sum())
    if missing:
        print(f"{missing} of {values.size} points failed (their logs are named above); run the same command again "
              f"to retry them: the finished points are kept")
        return 1
    Grid(list(axes), list(axes.values()), values, metric).save(search_dir / "grid.json")
    print(f"grid: {search_dir / 'grid.json'}; replay searches on it: python -m launch hpo-replay --grid "
          f"{search_dir / 'grid.json'} --out-dir DIR")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trial_arguments(parser)
    parser.add_argument("--axis", action="append", required=True, metavar="KEY=LOW:HIGH",
                        help="a grid axis: KEY=LOW:HIGH in multiplicative steps of --factor, or KEY=V1,V2,...; "
                             "once per key")
    parser.add_argument("--factor", type=number(float, above=1), default=2.0,
                        help="the multiplicative step of KEY=LOW:HIGH axes (default: %(default)s, the paper's)")
    add_cluster_arguments(parser)
