"""`python -m launch pipeline`: pretraining, the checkpoint-watching evaluation and the final evaluations (`python -m
eval PROTOCOL`, then the transfer stages) of the final export: with job dependencies on Slurm (the watcher starts
with the training, the final job once it succeeded), in order in one job locally."""
from __future__ import annotations

import argparse
from pathlib import Path

from launch.cluster import ClusterOptions, LaunchError, add_cluster_arguments, cluster_options, submit
from launch.eval_watch import check_protocols, split, watch_step
from launch.jobs import Step
from launch.pretrain import pretrain_run_dir, pretrain_step
from pretrain.runtime.argument_types import number, positive_float, positive_int
from transfer.finetune.config import load_finetune_config

HELP = "pretraining + checkpoint-watching evaluation + final evaluations"
DESCRIPTION = ("Submit pretraining, an `eval watch` job that starts with it, and the final evaluations once it "
               "succeeded (Slurm job dependencies); locally, one job runs them in order.")
TRANSFER_STAGES = ("finetune", "detection")


def final_steps(run_dir: Path, protocols: str, transfer: str, finetune_config: str | None = None) -> list[Step]:
    """Evaluations of the final export: `python -m eval PROTOCOL`, then the transfer stages (fine-tuning with
    `--config finetune_config` when given)."""
    steps = [Step("eval", [p, "--run", str(run_dir)], distributed=False) for p in split(protocols)]
    for stage in split(transfer):
        config = ["--config", str(Path(finetune_config).resolve())] if stage == "finetune" and finetune_config else []
        steps.append(Step("transfer", [stage, "--run", str(run_dir), *config], distributed=stage == "finetune"))
    return steps


def check_pipeline_arguments(args: argparse.Namespace) -> None:
    """What the jobs would fail on later, refused before anything is submitted (LaunchError names the value; the
    numbers are checked by their argparse types)."""
    check_protocols("--watch-protocols", args.watch_protocols, at_least_one=True)
    check_protocols("--final-protocols", args.final_protocols)
    unknown = [stage for stage in split(args.transfer) if stage not in TRANSFER_STAGES]
    if unknown:
        raise LaunchError(f"--transfer {args.transfer!r}: {', '.join(unknown)} is not a transfer stage; choose from "
                          f"{TRANSFER_STAGES}")
    if args.finetune_config is not None:
        if "finetune" not in split(args.transfer):
            raise LaunchError(f"--finetune-config {args.finetune_config} is given but --transfer has no finetune")
        load_finetune_config(args.finetune_config)           # a missing or bad recipe: ConfigError, exit 2


def evaluation_options(options: ClusterOptions, args: argparse.Namespace) -> ClusterOptions:
    """The evaluation jobs' resources: one task on one node, on a GPU when the training has GPUs (--eval-gpus
    overrides), with their own memory, cores and constraint (--eval-mem-gb, --eval-cpus-per-task,
    --eval-constraint; default: the cluster's default memory, the training's cores, no constraint), never
    --exclusive: a watcher does not need a whole node, nor the training node's type."""
    gpus = args.eval_gpus if args.eval_gpus is not None else min(options.gpus_per_node, 1)
    return ClusterOptions(**{**vars(options), "nodes": 1, "tasks_per_node": 1, "gpus_per_node": gpus,
                             "cpus_per_task": args.eval_cpus_per_task or options.cpus_per_task,
                             "mem_gb": args.eval_mem_gb, "constraint": args.eval_constraint,
                             "sbatch": {key: value for key, value in options.sbatch.items() if key != "exclusive"}})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="pretraining config (configs/pretrain/*.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--watch-protocols", default="knn",
                        help="protocols run on every checkpoint while training goes on (default: %(default)s)")
    parser.add_argument("--watch-poll-seconds", type=positive_float,
                        help="how often the watcher looks for new exports (default: eval watch's)")
    parser.add_argument("--final-protocols", default="linear",
                        help="protocols run on the final export only, after pretraining succeeded (default: "
                             "%(default)s; the watch protocols already ran on it)")
    parser.add_argument("--transfer", default="",
                        help="transfer stages run on the final export, e.g. finetune,detection (default: none)")
    parser.add_argument("--finetune-config", metavar="FILE",
                        help="the fine-tuning recipe of --transfer finetune (configs/transfer/*.yaml; default: "
                             "transfer finetune's built-in defaults)")
    evaluation = parser.add_argument_group("the evaluation jobs (watcher, final evaluations on one process)")
    evaluation.add_argument("--eval-gpus", type=number(int, at_least=0, at_most=1), metavar="N",
                            help="GPUs of the evaluation jobs, 0 or 1: they run one process (default: 1 when the "
                                 "training has GPUs)")
    evaluation.add_argument("--eval-cpus-per-task", type=positive_int, metavar="N",
                            help="CPU cores of an evaluation job (default: the training's --cpus-per-task)")
    evaluation.add_argument("--eval-mem-gb", type=positive_float, metavar="N",
                            help="memory of an evaluation job in GB (default: the partition's default)")
    evaluation.add_argument("--eval-constraint", metavar="CONSTRAINT",
                            help="node constraint of the evaluation jobs (default: none; the training's is not "
                                 "inherited, nor its --exclusive)")
    add_cluster_arguments(parser)


def run(args: argparse.Namespace) -> int:
    options = cluster_options(args)
    check_pipeline_arguments(args)
    run_dir = pretrain_run_dir(args.config, args.overrides)
    pretraining = pretrain_step(args.config, args.overrides, run_dir)
    # The watcher evaluates the final checkpoint too: the final job runs only the protocols it does not.
    final_protocols = ",".join(p for p in split(args.final_protocols) if p not in split(args.watch_protocols))
    finals = final_steps(run_dir, final_protocols, args.transfer, args.finetune_config)
    if options.cluster == "local":          # one local job: the stages in order
        steps = [pretraining, watch_step(run_dir, args.watch_protocols, args.watch_poll_seconds), *finals]
        submit(options, run_dir, "pipeline", steps)
        return 0
    training = submit(options, run_dir, "pretrain", [pretraining])
    single = evaluation_options(options, args)
    # The watcher starts with the training (after:) and stops when it ends unfinished (--until-job); the final
    # evaluations start once it succeeded (afterok:), and are cancelled by Slurm when it failed.
    submit(single, run_dir, "eval-watch", [watch_step(run_dir, args.watch_protocols, args.watch_poll_seconds,
                                                       until_job=training.job_id)],
           dependency=f"after:{training.job_id}")
    if finals:
        final_options = options if any(step.distributed for step in finals) else single
        submit(final_options, run_dir, "final-eval", finals, dependency=f"afterok:{training.job_id}")
    return 0
