"""python -m launch COMMAND: submit the stages as jobs, to a Slurm cluster or as local processes (submitit).

  pretrain     `python -m pretrain` as a job: one task per GPU (per process on CPUs), on N nodes; the job
               saves a checkpoint before its time limit and requeues itself; --sweep submits a job array
  finetune     `python -m transfer finetune` as a job (DeepSpeed, one task per GPU)
  eval-watch   `python -m eval watch` as a job: evaluates every checkpoint of a run while it trains (CPU or 1 GPU)
  pipeline     pretraining, the checkpoint-watching evaluation and the final evaluations: with job
               dependencies on Slurm, in order in one job locally
  status       job state, step and latest evaluation of a run, or of every run of a sweep, as a table
  grid         the objective (k-NN accuracy, R-mAP, ...) measured on a grid of config values, one job per point
  hpo          a hyper-parameter search whose trials are jobs: the balance paper's coordinate descent, or Optuna's
               random search, TPE, CMA-ES, in an Optuna study that a restarted search resumes
  hpo-replay   hyper-parameter searches (the balance paper's coordinate descent, Optuna's random, TPE, CMA-ES)
               replayed on a measured grid: AUC@10, AUC@20, n-95 and the mean best-so-far curves
  benchmark    a benchmark file's rows as jobs (pretraining runs with a budget of minutes or steps, evaluated at
               marks along the way; cross-entropy; raw pixels and random init): the table and the accuracy-against-
               minutes plot
  wheels       the wheels of the dependencies a machine without a package registry lacks (a GPU lease, a
               cluster's offline nodes), for its Python and platform, built here where only sources exist

Each command prints the job id, its log files and the run directory; every job submitted for a run is
recorded in RUN_DIR/jobs.jsonl (what `status` reads). Where a job runs comes from --preset (a YAML file of
cluster options, configs/launch/) and the flags, which override the preset; `--help` on a command lists them.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from launch.cluster import LaunchError
from pretrain.runtime.argument_types import CommandLineParser, add_command

# Each command is a module providing HELP, add_arguments(parser) and run(args) (pretrain/runtime/argument_types.py's
# add_command).
COMMANDS: dict[str, str] = {
    "pretrain": "launch.pretrain",
    "finetune": "launch.finetune",
    "eval-watch": "launch.eval_watch",
    "pipeline": "launch.pipeline",
    "status": "launch.status",
    "grid": "launch.grid",
    "hpo": "launch.hpo",
    "hpo-replay": "launch.hpo_replay",
    "benchmark": "launch.benchmark",
    "wheels": "launch.wheels",
}


def build_parser() -> argparse.ArgumentParser:
    parser = CommandLineParser(prog="python -m launch", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        add_command(commands, name, importlib.import_module(module))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)      # what a table says made it
    if unknown and not getattr(args, "passes_unknown", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        if getattr(args, "passes_unknown", False):       # launch finetune: what it does not know goes to the stage
            return args.handler(args, unknown)
        return args.handler(args)
    except LaunchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except ValueError as error:           # pretrain.config.ConfigError: a bad config, refused before submitting
        print(f"config error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
