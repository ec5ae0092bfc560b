"""`python -m launch finetune`: `python -m transfer finetune --run RUN_DIR ...` as a job (DeepSpeed, one task per
GPU); the options this command does not know go to `transfer finetune`, checked before the job is submitted."""
from __future__ import annotations

import argparse

from launch.cluster import LaunchError, add_cluster_arguments, cluster_options, existing_run, submit
from launch.jobs import Step
from transfer.__main__ import build_parser as transfer_parser
from transfer.finetune.config import load_finetune_config

HELP = "fine-tuning as a job"
DESCRIPTION = ("Submit `python -m transfer finetune --run RUN_DIR ...` as a job; options this command does not know "
               "go to `transfer finetune`.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, metavar="RUN_DIR", help="the pretraining run to fine-tune")
    add_cluster_arguments(parser)
    parser.set_defaults(passes_unknown=True)        # run(args, stage_args): the arguments of `transfer finetune`


def run(args: argparse.Namespace, stage_args: list[str]) -> int:
    options = cluster_options(args)
    run_dir = existing_run(args.run, "pass a pretraining run directory (it holds backbone.pth)")
    try:
        stage = transfer_parser().parse_args(["finetune", "--run", str(run_dir), *stage_args])
    except SystemExit:
        raise LaunchError(f"transfer finetune does not take {' '.join(stage_args)!r} (see python -m transfer "
                          "finetune --help)") from None
    load_finetune_config(stage.config, stage.overrides)     # a bad recipe or value: ConfigError, exit 2
    if stage.checkpoint is None and not (run_dir / "backbone.pth").is_file():
        raise LaunchError(f"--run {args.run} has no backbone.pth yet: wait for the pretraining to export one, or "
                          "pass --checkpoint EXPORT")
    submit(options, run_dir, "finetune", [Step("transfer", ["finetune", "--run", str(run_dir), *stage_args])])
    return 0
