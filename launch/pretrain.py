"""`python -m launch pretrain`: `python -m pretrain` as a job (one task per GPU, per process on CPUs, on N nodes;
it saves a checkpoint before its time limit and requeues itself), or with --sweep the product of config values as a
job array, one run directory each (SWEEP_DIR/sweep.json lists them for `launch status`)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from launch.cluster import add_cluster_arguments, cluster_options, submit, submit_array
from launch.jobs import Step
from launch.sweep import run_name, sweep_combinations
from pretrain.config import load_config, run_dir_of

HELP = "pretraining as a job (or a sweep as a job array)"
DESCRIPTION = ("Submit `python -m pretrain --config FILE [key=value ...]` as a job. Overrides come first, then "
               "--sweep.")
EPILOG = ("examples:\n  python -m launch pretrain --config configs/pretrain/dino_vit_small_imagenet_folder.yaml "
          "--preset slurm_example --nodes 2 --gpus-per-node 8\n  python -m launch pretrain --config configs/pretrain/"
          "simclr_digits.yaml --cluster local --sweep optim.lr=0.1,0.2,0.4 method.temperature=0.1,0.2")


def pretrain_run_dir(config: str | None, overrides: list[str]) -> Path:
    """The run directory the config describes; the config is loaded, so a bad one is refused at submission."""
    return run_dir_of(load_config(config, overrides)).resolve()


def pretrain_step(config: str | None, overrides: list[str], run_dir: Path) -> Step:
    argv = (["--config", str(Path(config).resolve())] if config else []) + [*overrides, f"run_dir={run_dir}"]
    return Step("pretrain", argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="pretraining config (configs/pretrain/*.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for python -m pretrain")
    parser.add_argument("--sweep", nargs="+", metavar="KEY=V1,V2", default=[],
                        help="submit the product of these values as one job array, one run directory each")
    parser.add_argument("--sweep-dir", help="where the sweep's runs go (default: runs/NAME_sweep)")
    add_cluster_arguments(parser)


def run(args: argparse.Namespace) -> int:
    options = cluster_options(args)
    if not args.sweep:
        run_dir = pretrain_run_dir(args.config, args.overrides)
        submit(options, run_dir, "pretrain", [pretrain_step(args.config, args.overrides, run_dir)])
        return 0
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
