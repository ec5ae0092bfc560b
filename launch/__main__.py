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

Each command prints the job id, its log files and the run directory; every job submitted for a run is
recorded in RUN_DIR/jobs.jsonl (what `status` reads). Where a job runs comes from --preset (a YAML file of
cluster options, configs/launch/) and the flags, which override the preset; `--help` on a command lists them.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from launch.cluster import (ClusterOptions, LaunchError, add_cluster_arguments, cluster_options, submit,
                            submit_array)
from launch.jobs import Step
from launch.sweep import run_name, sweep_combinations
from pretrain.runtime.argument_types import CommandLineParser, number, positive_float, positive_int


# ============ pretrain (and sweeps) ============

def pretrain_run_dir(config: str | None, overrides: list[str]) -> Path:
    """The run directory the config describes; the config is loaded, so a bad one is refused at submission."""
    from pretrain.config import load_config, run_dir_of

    return run_dir_of(load_config(config, overrides)).resolve()


def pretrain_step(config: str | None, overrides: list[str], run_dir: Path) -> Step:
    argv = (["--config", str(Path(config).resolve())] if config else []) + [*overrides, f"run_dir={run_dir}"]
    return Step("pretrain", argv)


def command_pretrain(args: argparse.Namespace) -> int:
    options = cluster_options(args)
    if not args.sweep:
        run_dir = pretrain_run_dir(args.config, args.overrides)
        submit(options, run_dir, "pretrain", [pretrain_step(args.config, args.overrides, run_dir)])
        return 0
    from pretrain.config import load_config

    base = load_config(args.config, args.overrides)
    sweep_dir = Path(args.sweep_dir or Path("runs") / f"{base.name}_sweep").resolve()
    runs = []
    for combination in sweep_combinations(args.sweep):
        name = run_name(base.name, combination)
        overrides = [*args.overrides, *combination, f"name={name}"]
        run_dir = sweep_dir / name
        load_config(args.config, [*overrides, f"run_dir={run_dir}"])       # refuse a bad value before submitting
        runs.append((name, combination, run_dir, [pretrain_step(args.config, overrides, run_dir)]))
    jobs = submit_array(options, sweep_dir / "jobs", sweep_dir.name, "pretrain",
                        [(run_dir, steps) for *_, run_dir, steps in runs])
    entries = [{"name": name, "overrides": combination, "run_dir": str(run_dir), "job_id": str(job.job_id)}
               for (name, combination, run_dir, _), job in zip(runs, jobs)]
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / "sweep.json").write_text(json.dumps({"config": args.config, "overrides": args.overrides,
                                                      "sweep": args.sweep, "runs": entries}, indent=1) + "\n")
    print(f"sweep of {len(runs)} runs in {sweep_dir}; follow it with: python -m launch status {sweep_dir}")
    return 0


# ============ evaluation, fine-tuning, pipeline ============

def watch_step(run_dir: Path, protocols: str, poll_seconds: float | None, follow: bool = False,
               until_job: str | None = None) -> Step:
    """`python -m eval watch ...`; options left as None keep eval watch's defaults."""
    return Step("eval", ["watch", "--run", str(run_dir), "--protocols", protocols,
                         *(["--poll-seconds", str(poll_seconds)] if poll_seconds is not None else []),
                         *(["--follow"] if follow else []), *(["--until-job", until_job] if until_job else [])],
                distributed=False)


def existing_run(run: str, what: str) -> Path:
    """The run directory a job works on, refused before submitting when it does not exist (a job would wait for
    it, or fail, long after the command returned)."""
    run_dir = Path(run).resolve()
    if not run_dir.is_dir():
        raise LaunchError(f"--run {run}: no such run directory; {what}")
    return run_dir


def command_eval_watch(args: argparse.Namespace) -> int:
    options = cluster_options(args)
    run_dir = existing_run(args.run, "start the pretraining first (or submit `launch pipeline`, whose watcher "
                                     "starts with it)")
    check_protocols("--protocols", args.protocols, at_least_one=True)
    submit(options, run_dir, "eval-watch", [watch_step(run_dir, args.protocols, args.poll_seconds, args.follow)])
    return 0


def command_finetune(args: argparse.Namespace, stage_args: list[str]) -> int:
    options = cluster_options(args)
    run_dir = existing_run(args.run, "pass a pretraining run directory (it holds backbone.pth)")
    from transfer.__main__ import build_parser as transfer_parser
    from transfer.finetune.config import load_finetune_config

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


TRANSFER_STAGES = ("finetune", "detection")


def final_steps(run_dir: Path, protocols: str, transfer: str, finetune_config: str | None = None) -> list[Step]:
    """Evaluations of the final export: `python -m eval PROTOCOL`, then the transfer stages (fine-tuning with
    `--config finetune_config` when given)."""
    steps = [Step("eval", [p, "--run", str(run_dir)], distributed=False) for p in split(protocols)]
    for stage in split(transfer):
        config = ["--config", str(Path(finetune_config).resolve())] if stage == "finetune" and finetune_config else []
        steps.append(Step("transfer", [stage, "--run", str(run_dir), *config], distributed=stage == "finetune"))
    return steps


def check_protocols(option: str, value: str, at_least_one: bool = False) -> None:
    """`value`, a comma-separated list of `python -m eval` protocols given as `option`, refused by name (with the
    option this command has) before a job would fail on it."""
    from eval.watch import PROTOCOLS

    unknown = [p for p in split(value) if p not in PROTOCOLS]
    if unknown:
        raise LaunchError(f"{option} {value!r}: {', '.join(unknown)} is not a protocol; choose from {PROTOCOLS}")
    if at_least_one and not split(value):
        raise LaunchError(f"{option} {value!r} names no protocol; choose from {PROTOCOLS}")


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
        from transfer.finetune.config import load_finetune_config

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


def split(text: str) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def command_pipeline(args: argparse.Namespace) -> int:
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


def command_status(args: argparse.Namespace) -> int:
    from launch.status import status_table

    if not Path(args.dir).is_dir():
        raise LaunchError(f"{args.dir}: no such directory; pass a run directory, a sweep directory or a folder of runs")
    print(status_table(Path(args.dir)))
    return 0


# ============ argument parsing ============

def build_parser() -> argparse.ArgumentParser:
    parser = CommandLineParser(prog="python -m launch", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    pretrain = commands.add_parser("pretrain", help="pretraining as a job (or a sweep as a job array)",
                                   description="Submit `python -m pretrain --config FILE [key=value ...]` as a job. "
                                               "Overrides come first, then --sweep.",
                                   epilog="examples:\n  python -m launch pretrain --config configs/pretrain/"
                                          "dino_vit_small_imagenet_folder.yaml --preset slurm_example --nodes 2 "
                                          "--gpus-per-node 8\n  python -m launch pretrain --config configs/pretrain/"
                                          "simclr_digits.yaml --cluster local --sweep optim.lr=0.1,0.2,0.4 "
                                          "method.temperature=0.1,0.2",
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    pretrain.add_argument("--config", help="pretraining config (configs/pretrain/*.yaml)")
    pretrain.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for python -m pretrain")
    pretrain.add_argument("--sweep", nargs="+", metavar="KEY=V1,V2", default=[],
                          help="submit the product of these values as one job array, one run directory each")
    pretrain.add_argument("--sweep-dir", help="where the sweep's runs go (default: runs/NAME_sweep)")
    add_cluster_arguments(pretrain)
    pretrain.set_defaults(handler=command_pretrain)

    finetune = commands.add_parser("finetune", help="fine-tuning as a job",
                                   description="Submit `python -m transfer finetune --run RUN_DIR ...` as a job; "
                                               "options this command does not know go to `transfer finetune`.")
    finetune.add_argument("--run", required=True, metavar="RUN_DIR", help="the pretraining run to fine-tune")
    add_cluster_arguments(finetune)
    finetune.set_defaults(handler=command_finetune, passes_unknown=True)

    watch = commands.add_parser("eval-watch", help="the checkpoint-watching evaluation as a job",
                                description="Submit `python -m eval watch --run RUN_DIR` as a one-task job (CPU, or "
                                            "--gpus-per-node 1): every checkpoint of the run evaluated once, in step "
                                            "order, while it trains.")
    watch.add_argument("--run", required=True, metavar="RUN_DIR")
    watch.add_argument("--protocols", default="knn,linear", help="protocols per checkpoint (default: %(default)s)")
    watch.add_argument("--follow", action="store_true", help="keep watching after the run has finished")
    watch.add_argument("--poll-seconds", type=positive_float,
                       help="how often the watcher looks for new exports (default: eval watch's)")
    add_cluster_arguments(watch)
    watch.set_defaults(handler=command_eval_watch)

    pipeline = commands.add_parser("pipeline", help="pretraining + checkpoint-watching evaluation + final evaluations",
                                   description="Submit pretraining, an `eval watch` job that starts with it, and the "
                                               "final evaluations once it succeeded (Slurm job dependencies); "
                                               "locally, one job runs them in order.")
    pipeline.add_argument("--config", help="pretraining config (configs/pretrain/*.yaml)")
    pipeline.add_argument("overrides", nargs="*", metavar="key=value")
    pipeline.add_argument("--watch-protocols", default="knn",
                          help="protocols run on every checkpoint while training goes on (default: %(default)s)")
    pipeline.add_argument("--watch-poll-seconds", type=positive_float,
                          help="how often the watcher looks for new exports (default: eval watch's)")
    pipeline.add_argument("--final-protocols", default="linear",
                          help="protocols run on the final export only, after pretraining succeeded (default: "
                               "%(default)s; the watch protocols already ran on it)")
    pipeline.add_argument("--transfer", default="",
                          help="transfer stages run on the final export, e.g. finetune,detection (default: none)")
    pipeline.add_argument("--finetune-config", metavar="FILE",
                          help="the fine-tuning recipe of --transfer finetune (configs/transfer/*.yaml; default: "
                               "transfer finetune's built-in defaults)")
    evaluation = pipeline.add_argument_group("the evaluation jobs (watcher, final evaluations on one process)")
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
    add_cluster_arguments(pipeline)
    pipeline.set_defaults(handler=command_pipeline)

    status = commands.add_parser("status", help="jobs, steps and latest evaluations of a run or a sweep",
                                 description="A table of every run under DIR (a run directory, a sweep directory, "
                                             "or a folder of runs): job, state, step, latest evaluation.")
    status.add_argument("dir", metavar="DIR")
    status.set_defaults(handler=command_status)

    from launch import hpo, hpo_replay
    grid = commands.add_parser("grid", help="the objective measured on a grid of config values, as a sweep of jobs",
                               description=hpo.__doc__ + "\n`grid`: every point of the product of the --axis values "
                               "is a trial; SEARCH_DIR/grid.json is what `hpo-replay` reads.",
                               epilog="example:\n  python -m launch grid --config configs/pretrain/simclr_digits.yaml "
                                      "--axis method.lambda_p=0.0625:4 --axis method.lambda_e=0.0625:4 --objective "
                                      "knn:top1.20 --cluster local --out-dir runs/grid_simclr",
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    hpo.add_grid_arguments(grid)
    add_cluster_arguments(grid)
    grid.set_defaults(handler=hpo.run_grid)

    search = commands.add_parser("hpo", help="a hyper-parameter search whose trials are jobs (cd, random, tpe, cmaes)",
                                 description=hpo.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="example:\n  python -m launch hpo --config configs/pretrain/simclr_digits.yaml "
                                        "--space method.lambda_p=0.0625:4:log --space method.lambda_e=0.0625:4:log "
                                        "--method cd --trials 20 --cluster local --out-dir runs/hpo_simclr_cd")
    hpo.add_search_arguments(search)
    add_cluster_arguments(search)
    search.set_defaults(handler=hpo.run_search)

    replay = commands.add_parser("hpo-replay", help="searches replayed on a measured grid (the paper's Table 1-2)",
                                 description=hpo_replay.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hpo_replay.add_arguments(replay)
    replay.set_defaults(handler=hpo_replay.run_replay)

    from launch import benchmark
    bench = commands.add_parser("benchmark", help="a benchmark file's rows as jobs: the table and the plot of accuracy "
                                                  "against minutes of training",
                                description=benchmark.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="example:\n  python -m launch benchmark configs/benchmarks/digits.yaml "
                                       "--cluster local --out-dir runs/benchmark_digits")
    benchmark.add_arguments(bench)
    add_cluster_arguments(bench)
    bench.set_defaults(handler=benchmark.run_benchmark)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)      # what a table says made it
    if unknown and not getattr(args, "passes_unknown", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        if getattr(args, "passes_unknown", False):
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
