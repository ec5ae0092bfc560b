"""`python -m launch eval-watch`: `python -m eval watch` as a one-task job (CPU or 1 GPU), evaluating every
checkpoint of a run while it trains; `watch_step` is also the watcher of `launch pipeline`."""
from __future__ import annotations

import argparse
from pathlib import Path

from launch.cluster import LaunchError, add_cluster_arguments, cluster_options, existing_run, submit
from launch.jobs import Step
from pretrain.runtime.argument_types import positive_float

HELP = "the checkpoint-watching evaluation as a job"
DESCRIPTION = ("Submit `python -m eval watch --run RUN_DIR` as a one-task job (CPU, or --gpus-per-node 1): every "
               "checkpoint of the run evaluated once, in step order, while it trains.")


def watch_step(run_dir: Path, protocols: str, poll_seconds: float | None, follow: bool = False,
               until_job: str | None = None) -> Step:
    """`python -m eval watch ...`; options left as None keep eval watch's defaults."""
    return Step("eval", ["watch", "--run", str(run_dir), "--protocols", protocols,
                         *(["--poll-seconds", str(poll_seconds)] if poll_seconds is not None else []),
                         *(["--follow"] if follow else []), *(["--until-job", until_job] if until_job else [])],
                distributed=False)


def split(text: str) -> list[str]:
    """The items of a comma-separated option (protocols, transfer stages)."""
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def check_protocols(option: str, value: str, at_least_one: bool = False) -> None:
    """`value`, a comma-separated list of `python -m eval` protocols given as `option`, refused by name (with the
    option this command has) before a job would fail on it."""
    from eval.watch import PROTOCOLS    # eval brings timm and deepspeed: only a command with protocols pays for them

    unknown = [p for p in split(value) if p not in PROTOCOLS]
    if unknown:
        raise LaunchError(f"{option} {value!r}: {', '.join(unknown)} is not a protocol; choose from {PROTOCOLS}")
    if at_least_one and not split(value):
        raise LaunchError(f"{option} {value!r} names no protocol; choose from {PROTOCOLS}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, metavar="RUN_DIR")
    parser.add_argument("--protocols", default="knn,linear", help="protocols per checkpoint (default: %(default)s)")
    parser.add_argument("--follow", action="store_true", help="keep watching after the run has finished")
    parser.add_argument("--poll-seconds", type=positive_float,
                        help="how often the watcher looks for new exports (default: eval watch's)")
    add_cluster_arguments(parser)


def run(args: argparse.Namespace) -> int:
    options = cluster_options(args)
    run_dir = existing_run(args.run, "start the pretraining first (or submit `launch pipeline`, whose watcher "
                                     "starts with it)")
    check_protocols("--protocols", args.protocols, at_least_one=True)
    submit(options, run_dir, "eval-watch", [watch_step(run_dir, args.protocols, args.poll_seconds, args.follow)])
    return 0
