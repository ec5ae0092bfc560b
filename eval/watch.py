"""`python -m eval watch --run RUN_DIR --protocols knn,linear [--follow]`: evaluate every checkpoint of a
pretraining run, exactly once and in step order, while the run goes on.

Pretraining publishes a backbone export per checkpoint, RUN_DIR/exports/backbone_stepNNNNNNNN.pth, written to a
temporary name and renamed (a file that is there is complete), and appends its step to
exports/published.txt. For every step published or exported (an export on disk is complete, so one whose step is
not listed, e.g. after published.txt was deleted, is evaluated all the same) and every protocol without a result
RUN_DIR/eval/<protocol>_stepNNNNNNN.json (with --train, --val, --image-size or --crop-fraction other than the run's
own, the name the protocol gives such a result, e.g. knn_at_24px_stepNNNNNNN.json), oldest step first, the
watcher runs the protocol on that export (`python -m eval <protocol> --checkpoint EXPORT --run RUN_DIR`): the
JSON, written last and atomically, is the record that it is done, and its TensorBoard scalars land in RUN_DIR/tb
at that step, next to the training curves. A watcher killed mid-evaluation and restarted therefore evaluates
nothing twice and completes the interrupted one. An export deleted before it was evaluated (a retention set with
engine.keep_exports) is listed as skipped. One watcher per run: RUN_DIR/eval/watch.lock. A step's cached features
(RUN_DIR/eval/features_stepNNNNNNN.pt, as large as the features of the training set) are deleted once every
protocol has run on it.

It exits when the run has finished (RUN_DIR/finished.json) and every published export is evaluated; with
--follow it keeps waiting for new checkpoints (e.g. of a run that will be resumed). With --until-job JOBID (the
pretraining's Slurm job; `python -m launch pipeline` passes it) it also stops, with exit status 1, once that
job has ended without finishing the run (failed, cancelled, out of requeues), after evaluating what it
published: a watcher does not wait out its time limit for a run that will not go on.

SIGUSR2 (the scheduler's time-limit warning), SIGTERM and SIGINT stop the watcher at its next stop point (the next
batch of the evaluation under way, or within half a second of a wait: eval/stop_points.py), the evaluation under
way abandoned (its result is written last, so it is simply redone), with exit status 128 + signal: `launch`
requeues a watcher job at its time limit like the training it follows, and the requeued watcher goes on where
this one stopped.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from eval import knn, linear, retrieval
from eval.features import EvaluationInputError
from eval.inputs import add_data_options
from eval.results import evaluation_suffix, feature_cache_path, result_path
from eval.stop_points import clear_stop_request, request_stop, sleep_to_stop_point, stop_point
from pretrain.export import EXPORTS, export_path, published_export_steps
from pretrain.runtime.argument_types import CommandLineParser, number
from pretrain.runtime.graceful_stop import PENDING_STOP_SIGNAL
from pretrain.runtime.run_lock import RunDirectoryInUse, RunLock

# The sub-commands of `python -m eval` the watcher can run, by name: their modules' add_arguments and run.
PROTOCOL_COMMANDS = {"knn": knn, "linear": linear, "retrieval": retrieval}
PROTOCOLS = tuple(PROTOCOL_COMMANDS)
FORWARDED = ("train", "val", "image_size", "crop_fraction", "device", "num_workers", "feature_batch_size")

HELP = "evaluate every checkpoint of a (running) pretraining run, once each"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, metavar="RUN_DIR", help="the pretraining run directory to follow")
    parser.add_argument("--protocols", default="knn,linear",
                        help=f"comma-separated protocols to run on every checkpoint, of {PROTOCOLS} "
                             "(default: %(default)s)")
    parser.add_argument("--follow", action="store_true",
                        help="keep waiting for new checkpoints after the run has finished")
    parser.add_argument("--poll-seconds", type=number(float, above=0), default=30.0,
                        help="how often to look for new exports (default: %(default)s)")
    parser.add_argument("--until-job", metavar="JOBID",
                        help="the pretraining's Slurm job: stop (exit status 1) once it has ended without "
                             "finishing the run")
    add_data_options(parser)


def run(args: argparse.Namespace) -> int:
    return watch(args)


# Slurm job states (squeue %T) of a job that may still write checkpoints, requeued ones included.
LIVE_JOB_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_FED",
                   "REQUEUE_HOLD", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD", "SPECIAL_EXIT")


SQUEUE_UNANSWERED = "UNKNOWN (squeue did not answer)"   # not a verdict: taken as alive, asked again next poll


def slurm_job_state(job_id: str) -> str | None:
    """The job's state as squeue reports it, or None once squeue no longer knows the job."""
    try:
        result = subprocess.run(["squeue", "-h", "--states=all", "-j", job_id, "-o", "%T"], capture_output=True,
                                text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return SQUEUE_UNANSWERED
    states = result.stdout.split()
    return states[0] if result.returncode == 0 and states else None


def job_has_ended(job_id: str, grace_seconds: float) -> str | None:
    """The final state of `job_id` ("gone from squeue" when purged), or None while it lives. A state that
    looks final is asked again after `grace_seconds`, so a job caught between a stop and its requeue is
    not taken for ended."""
    def alive(state: str | None) -> bool:
        return state in LIVE_JOB_STATES or state == SQUEUE_UNANSWERED

    if alive(slurm_job_state(job_id)):
        return None
    sleep_to_stop_point(grace_seconds)
    state = slurm_job_state(job_id)
    return None if alive(state) else state or "gone from squeue"


EXPORT_NAME = re.compile(r"backbone_step(\d{8})\.pth")     # export_path's name; a temporary one starts with "."


def exported_steps(run_dir: Path) -> list[int]:
    """The steps of the exports on disk, every one complete (written to a temporary name, then renamed)."""
    names = [EXPORT_NAME.fullmatch(path.name) for path in (Path(run_dir) / EXPORTS).glob("backbone_step*.pth")]
    return [int(name.group(1)) for name in names if name]


def pending(run_dir: Path, protocols: list[str], suffix: str = "") -> tuple[list[tuple[int, str]], list[int]]:
    """(step, protocol) pairs still to evaluate, oldest first, and the published steps whose export was
    deleted before every protocol ran on it. The exports on disk count as published: exports/published.txt adds
    the steps of those since rotated away, and a run whose list is lost (deleted; pretraining would start a new one
    at its next checkpoint) still has every export evaluated, not reported as done with none. `suffix`: what the
    results' names carry after the protocol's (`result_suffix`)."""
    todo, skipped = [], []
    for step in sorted(set(published_export_steps(run_dir)) | set(exported_steps(run_dir))):
        missing = [p for p in protocols if not result_path(run_dir, p + suffix, step).is_file()]
        if not missing:
            continue
        if export_path(run_dir, step).is_file():
            todo += [(step, p) for p in missing]
        else:
            skipped.append(step)
    return todo, skipped


def run_config(run_dir: Path) -> dict:
    """The run's resolved config: RUN_DIR/config.yaml, which pretraining writes before its first export, else the
    config inside the newest readable export ({} while there is neither)."""
    path = run_dir / "config.yaml"
    if path.is_file():
        from omegaconf import OmegaConf

        return OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    import torch

    for step in sorted(exported_steps(run_dir), reverse=True):
        try:
            return torch.load(export_path(run_dir, step), map_location="cpu", weights_only=True, mmap=True)["config"]
        except Exception:  # rotated away or unreadable: an older one will do, they share the run's config
            continue
    return {}


def result_suffix(run_dir: Path, args: argparse.Namespace) -> str:
    """What the protocols add to their results' names when run with this watcher's data options
    (`eval.results.evaluation_suffix`): "" without any, or with the run's own data, side and crop."""
    if all(getattr(args, name, None) is None for name in ("train", "val", "image_size", "crop_fraction")):
        return ""                                   # the run's own: no config to read
    return evaluation_suffix(run_config(run_dir), args.train, args.val, args.image_size, args.crop_fraction)


def parse_protocol_arguments(protocol: str, argv: list[str]) -> argparse.Namespace:
    """The arguments of `python -m eval PROTOCOL ARGV`, refused as that command line refuses them (SystemExit after
    one line): by the protocol's parser, and an argument it does not know by `python -m eval`'s, as argparse does."""
    parser = CommandLineParser(prog=f"python -m eval {protocol}")
    PROTOCOL_COMMANDS[protocol].add_arguments(parser)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        CommandLineParser(prog="python -m eval").error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def evaluate(argv: list[str]) -> None:
    """Run one protocol in this process as `python -m eval ARGV` would, its errors let through: how the watcher
    evaluates an export."""
    PROTOCOL_COMMANDS[argv[0]].run(parse_protocol_arguments(argv[0], argv[1:]))


def run_protocol(args: argparse.Namespace, protocol: str, step: int,
                 evaluate: Callable[[list[str]], object]) -> None:
    """`python -m eval PROTOCOL --run RUN_DIR --checkpoint EXPORT [data options]`, run by `evaluate`."""
    argv = [protocol, "--run", str(args.run), "--checkpoint", str(export_path(args.run, step))]
    for name in FORWARDED:
        value = getattr(args, name, None)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    evaluate(argv)


class WatcherStopped(BaseException):
    """A stop signal reached the watcher (raised at the next stop point, `eval/stop_points.py`; a BaseException, as
    KeyboardInterrupt, so that no `except Exception` of an evaluation swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """The watcher's handler of its stop signals: it records the signal and asks for a stop at the next stop point
    (`eval/stop_points.py`: the next batch of the evaluation under way, or the watcher's next check), never raising
    where the signal lands: an exception raised there cut numba's compiler or an LLVM disposal in half and the
    watcher crashed in libllvmlite; one raised inside a finalizer (numba's weakref callback, "Exception ignored in
    ... on_disposal") was dropped by Python."""

    def __init__(self):
        self.received: int | None = None

    def __call__(self, signum: int, frame) -> None:
        self.received = self.received or signum
        request_stop(WatcherStopped(self.received))

    def check(self) -> None:
        """Raise WatcherStopped for a signal received earlier."""
        stop_point()


def watch(args: argparse.Namespace, evaluate: Callable[[list[str]], object] = evaluate) -> int:
    """Follow `args.run` (see the module docstring); `evaluate(argv)` runs one `python -m eval` protocol command (in
    this process; a test passes its own)."""
    run_dir = Path(args.run)
    protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    unknown = [p for p in protocols if p not in PROTOCOLS]
    if unknown or not protocols:
        raise EvaluationInputError(f"--protocols {args.protocols!r}: {unknown or 'none given'}; choose from {PROTOCOLS}")
    if not run_dir.is_dir():
        raise EvaluationInputError(f"--run {run_dir}: no such run directory (start the pretraining first, or "
                                   "pass the run's directory)")
    (run_dir / "eval").mkdir(exist_ok=True)
    lock = RunLock(run_dir / "eval", "watch.lock")
    try:
        taken_over = lock.acquire()
    except RunDirectoryInUse as error:
        holder = str(error).split(": two runs")[0]          # "RUN_DIR/eval is in use by pid P on HOST (since T)"
        raise EvaluationInputError(f"another watcher follows this run ({holder}); one watcher per run evaluates "
                                   "every checkpoint: leave it running, or stop it and start this one. If it is "
                                   f"gone (e.g. its node died), delete {run_dir / 'eval' / 'watch.lock'}") from None
    if taken_over:
        print(taken_over, file=sys.stderr, flush=True)
    reported_skips: set[int] = set()
    evaluated = 0

    def report_skip(step: int) -> None:
        feature_cache_path(run_dir, step).unlink(missing_ok=True)
        if step not in reported_skips:
            print(f"skipped step {step}: its export was deleted before it was evaluated (engine.keep_exports)",
                  flush=True)
            reported_skips.add(step)

    stop_signals = StopSignals()
    previous = {signum: signal.signal(signum, stop_signals) for signum in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)}
    try:
        pending_signal = os.environ.pop(PENDING_STOP_SIGNAL, None)   # one that reached the job before this handler
        if pending_signal:
            raise WatcherStopped(int(pending_signal))
        print(f"watching {run_dir} for checkpoints to evaluate with {', '.join(protocols)}", flush=True)
        while True:
            # The job's state first, then finished.json, then the exports: a job that ended after writing
            # finished.json is seen finished, and whatever it published is evaluated before the verdict.
            ended = job_has_ended(args.until_job, min(args.poll_seconds, 10.0)) if args.until_job else None
            finished = (run_dir / "finished.json").is_file()      # read first: the exports are complete by then
            todo, skipped = pending(run_dir, protocols, result_suffix(run_dir, args))
            for step in skipped:
                report_skip(step)
            last_of_step = {step: (step, protocol) for step, protocol in todo}   # the step's last protocol to run
            for step, protocol in todo:
                stop_signals.check()
                # Re-checked for each one: the run rotates old exports away (engine.keep_exports) while the
                # watcher works through the list, possibly while one of them is being read.
                if not export_path(run_dir, step).is_file():
                    report_skip(step)
                    continue
                print(f"evaluating step {step}: {protocol}", flush=True)
                try:
                    run_protocol(args, protocol, step, evaluate)
                except (EvaluationInputError, OSError):
                    if export_path(run_dir, step).is_file():
                        raise
                    report_skip(step)
                    continue
                evaluated += 1
                if (step, protocol) == last_of_step[step]:
                    # the step's cached features (as large as the training set's features) are no longer needed
                    feature_cache_path(run_dir, step).unlink(missing_ok=True)
            stop_signals.check()
            if todo:
                continue                     # new exports may have appeared meanwhile
            if finished and not args.follow:
                print(f"done: {run_dir} has finished and every published checkpoint is evaluated "
                      f"({evaluated} evaluations now, {len(reported_skips)} checkpoints skipped)", flush=True)
                return 0
            if ended and not finished:
                print(f"stopped: the pretraining job {args.until_job} has ended ({ended}) without finishing "
                      f"{run_dir}; {evaluated} evaluations now, every published checkpoint evaluated. Resume the "
                      f"run (submit it again) and start a new watcher", file=sys.stderr, flush=True)
                return 1
            sleep_to_stop_point(args.poll_seconds)
    except WatcherStopped as stop:
        print(f"stopped on {stop}: {evaluated} evaluations now; rerun the same command (a requeued job does) to go "
              "on", file=sys.stderr, flush=True)
        return 128 + stop.signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        clear_stop_request()
        lock.release()
