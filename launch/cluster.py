"""Where a job runs and with what: cluster options from presets and flags, turned into a submitit executor.

    options = cluster_options(args)                    # configs/launch/<preset>.yaml <- command-line flags
    executor = build_executor(options, folder, "pretrain")

A preset is a YAML file of these options (configs/launch/local.yaml, configs/launch/slurm_example.yaml);
flags given on the command line override it. `cluster: slurm` submits with sbatch through submitit (one task
per GPU, or `tasks_per_node` processes on CPUs); `cluster: local` runs the same job as local processes;
`cluster: auto` is Slurm where `sbatch` and `srun` exist, local elsewhere. `cluster: slurm` where they do not, or an
sbatch that refuses the job (no controller answers), is one line naming it: nothing is left behind.

The sbatch parameters are a pure function of the options (`slurm_parameters`), so the submission script can be
built and checked where Slurm is not installed.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import io
import json
import math
import re
import shutil
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from launch.jobs import StageJob, Step
from pretrain.runtime.argument_types import number, parse_number

PRESETS = Path(__file__).resolve().parents[1] / "configs" / "launch"


class LaunchError(ValueError):
    """A launch the user must fix (a bad option or preset); the message names the value and what to do."""


@dataclass
class ClusterOptions:
    cluster: str = "auto"                  # slurm | local | auto (slurm where sbatch and srun exist)
    nodes: int = 1
    gpus_per_node: int = 0                 # one task per GPU; 0: a CPU job
    tasks_per_node: int | None = None      # processes per node (default: gpus_per_node, or 1 on CPUs)
    cpus_per_task: int = 2
    mem_gb: float | None = None            # per node; None: the partition's default
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    time: str = "60"                       # time limit: minutes, or [D-]HH:MM:SS
    max_requeues: int = 10                 # time-limit requeues before the job gives up
    signal_delay_s: int = 120              # SIGUSR2 this many seconds before the time limit
    job_name: str | None = None
    sbatch: dict[str, str] = dataclasses.field(default_factory=dict)   # further #SBATCH options, e.g. {exclusive: ""}

    @property
    def tasks(self) -> int:
        return self.tasks_per_node or self.gpus_per_node or 1


# The numeric options' kind and range, written once: the flags' argparse types and a preset's values are both
# checked against them (pretrain/runtime/argument_types.py: finite, in range, one line naming the value).
NUMBER_RANGES = {"nodes": (int, {"at_least": 1}), "gpus_per_node": (int, {"at_least": 0}),
                 "tasks_per_node": (int, {"at_least": 1}), "cpus_per_task": (int, {"at_least": 1}),
                 "mem_gb": (float, {"above": 0}), "max_requeues": (int, {"at_least": 0}),
                 "signal_delay_s": (int, {"at_least": 1})}

OPTION_HELP = {
    "cluster": "slurm, local, or auto (slurm where sbatch and srun exist)",
    "nodes": "nodes (Slurm)",
    "gpus_per_node": "GPUs per node; one task (process) per GPU; 0 for a CPU job",
    "tasks_per_node": "processes per node (default: gpus-per-node, or 1 on CPUs)",
    "cpus_per_task": "CPU cores per process (data loading threads)",
    "mem_gb": "memory per node in GB",
    "partition": "Slurm partition",
    "account": "Slurm account",
    "qos": "Slurm quality of service",
    "constraint": "Slurm node constraint (e.g. a GPU type)",
    "time": "time limit: minutes, or [D-]HH:MM:SS; the job requeues itself at the limit",
    "max_requeues": "time-limit requeues before the job stops for good",
    "signal_delay_s": "seconds before the time limit at which the job saves a checkpoint and requeues",
    "job_name": "job name (default: the run's name)",
}


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """--preset and one flag per ClusterOptions field; a flag left out keeps the preset's value."""
    group = parser.add_argument_group("where the job runs (flags override --preset)")
    group.add_argument("--preset", metavar="NAME_OR_FILE",
                       help=f"cluster options from a YAML file, or the name of one in {PRESETS} "
                            "(local, slurm_example)")
    for field in fields(ClusterOptions):
        if field.name == "sbatch":
            group.add_argument("--sbatch", action="append", default=[], metavar="KEY=VALUE",
                               help="a further #SBATCH option, e.g. --sbatch exclusive= --sbatch mail-type=END "
                                    "(repeatable)")
            continue
        default = f" (default: {field.default})" if field.default is not None else ""
        if field.name in NUMBER_RANGES:
            kind, limits = NUMBER_RANGES[field.name]
            group.add_argument(f"--{field.name.replace('_', '-')}", dest=field.name, type=number(kind, **limits),
                               default=None, metavar="N", help=OPTION_HELP[field.name] + default)
        else:
            group.add_argument(f"--{field.name.replace('_', '-')}", dest=field.name, default=None,
                               metavar=field.name.split("_")[0].upper(), help=OPTION_HELP[field.name] + default)


def load_preset(name_or_path: str) -> dict:
    path = Path(name_or_path)
    if not path.suffix:
        path = PRESETS / f"{name_or_path}.yaml"
    if not path.is_file():
        available = sorted(p.stem for p in PRESETS.glob("*.yaml"))
        raise LaunchError(f"--preset {name_or_path!r}: no file {path}; the presets are {available}, or pass a path")
    try:
        preset = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise LaunchError(f"--preset {path} is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(preset, dict):
        raise LaunchError(f"--preset {path} must be a mapping of cluster options (as configs/launch/local.yaml)")
    known = [f.name for f in fields(ClusterOptions)]
    for key in preset:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; the options are {known}"
            raise LaunchError(f"--preset {path}: unknown option {key!r}{hint}")
        if key in NUMBER_RANGES and preset[key] is not None:
            kind, limits = NUMBER_RANGES[key]
            try:
                preset[key] = parse_number(str(preset[key]), kind, **limits)
            except ValueError as error:
                raise LaunchError(f"--preset {path}: {key}: {error}") from None
    return preset


def cluster_options(args: argparse.Namespace) -> ClusterOptions:
    """The preset (if any), overridden by every flag given on the command line; checked."""
    values = load_preset(args.preset) if getattr(args, "preset", None) else {}
    for field in fields(ClusterOptions):
        given = getattr(args, field.name, None)
        if field.name == "sbatch":
            extra = dict(values.get("sbatch") or {})
            for item in given or []:
                if "=" not in item:
                    raise LaunchError(f"--sbatch {item!r} must be KEY=VALUE (KEY= for a flag without a value)")
                key, value = item.split("=", 1)
                extra[key] = value
            values["sbatch"] = extra
        elif given is not None:
            values[field.name] = given
    try:
        options = ClusterOptions(**values)
    except TypeError as error:
        raise LaunchError(f"cluster options: {error}") from None
    check(options)
    if options.cluster == "auto":
        options.cluster = "slurm" if not missing_slurm_commands() else "local"
    elif options.cluster == "slurm" and missing_slurm_commands():
        raise LaunchError(f"--cluster slurm: Slurm was not found here ({' and '.join(missing_slurm_commands())} not "
                          "on PATH): submit from a Slurm login node, or pass --cluster local to run the same job on "
                          "this machine")
    return options


def missing_slurm_commands() -> list[str]:
    """The Slurm commands a submission needs (sbatch submits; submitit's SlurmExecutor wants srun) not on PATH."""
    return [command for command in ("sbatch", "srun") if shutil.which(command) is None]


def time_limit_minutes(text: str) -> int:
    """The minutes of a Slurm time limit, in every form `sbatch --time` accepts: 'M', 'M:S', 'H:M:S', 'D-H',
    'D-H:M', 'D-H:M:S' ('90' -> 90; '2:00:00' -> 120; '1-12' -> 2160; '1-12:30' -> 2190; '0:30' -> 1: Slurm
    rounds seconds up to a whole minute)."""
    text = str(text).strip()
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not match:
        raise LaunchError(f"--time {text!r} is not one of Slurm's forms: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
                          "D-HH:MM:SS (e.g. --time 120, --time 2:00:00 or --time 1-12)")
    days, first, second, third = (int(group) if group is not None else None for group in match.groups())
    if days is not None:                                 # D-HH[:MM[:SS]]: after a day, the first field is hours
        seconds = days * 86400 + first * 3600 + (second or 0) * 60 + (third or 0)
    elif second is None:                                 # minutes
        seconds = first * 60
    elif third is None:                                  # MM:SS
        seconds = first * 60 + second
    else:                                                # HH:MM:SS
        seconds = first * 3600 + second * 60 + third
    if seconds == 0:
        # Slurm reads a zero limit as "no limit": the job would never get its signal to checkpoint and requeue.
        raise LaunchError(f"--time {text!r} is Slurm's 'no time limit', but a job saves a checkpoint and requeues "
                          "itself before its limit, so it needs one: give minutes or [D-]HH:MM:SS (e.g. --time "
                          "2-00:00:00; the job requeues itself at each limit, up to --max-requeues times)")
    return max(1, -(-seconds // 60))


def check(options: ClusterOptions) -> None:
    """The options together (each number's range is checked where it is read: NUMBER_RANGES)."""
    if options.cluster not in ("slurm", "local", "auto"):
        raise LaunchError(f"--cluster {options.cluster!r} is not one of slurm, local, auto")
    minutes = time_limit_minutes(options.time)
    if options.signal_delay_s >= minutes * 60:
        raise LaunchError(f"--signal-delay-s {options.signal_delay_s} must be shorter than the time limit "
                          f"({minutes} min): the job saves and requeues that long before the limit")
    if options.cluster == "local" and options.nodes > 1:
        raise LaunchError(f"--nodes {options.nodes} needs --cluster slurm; a local job runs on this machine")


def sbatch_flags(extra: dict) -> dict:
    """--sbatch KEY=VALUE options for submitit: an empty value (KEY=, or `KEY: ''` in a preset) or `true` is a bare
    flag (`#SBATCH --exclusive`, not `--exclusive=''`)."""
    return {key: True if value in ("", True, None) or str(value).lower() == "true" else value
            for key, value in extra.items()}


def slurm_parameters(options: ClusterOptions, job_name: str, dependency: str | None = None) -> dict:
    """The sbatch parameters of a job, in submitit's names (what SlurmExecutor.update_parameters and
    submitit.slurm.slurm._make_sbatch_string take): a pure function of the options, so the script is built and
    checked without Slurm. `dependency`: Slurm's `--dependency` (e.g. `afterok:123`)."""
    additional = {"requeue": True, **sbatch_flags(options.sbatch)}
    parameters = dict(job_name=options.job_name or job_name, time=time_limit_minutes(options.time),
                      nodes=options.nodes, ntasks_per_node=options.tasks, cpus_per_task=options.cpus_per_task,
                      signal_delay_s=options.signal_delay_s, additional_parameters=additional)
    if dependency:
        # kill-on-invalid-dep: a job whose dependency can no longer be met is cancelled, not left pending
        parameters["dependency"] = dependency
        additional["kill-on-invalid-dep"] = "yes"
    if options.gpus_per_node:
        parameters["gpus_per_node"] = options.gpus_per_node
    if options.mem_gb:
        parameters["mem"] = f"{math.ceil(options.mem_gb * 1024)}M"      # never --mem=0: Slurm's "all the memory"
    for name in ("partition", "account", "qos", "constraint"):
        if getattr(options, name):
            parameters[name] = getattr(options, name)
    return parameters


def build_executor(options: ClusterOptions, folder: Path, job_name: str, dependency: str | None = None):
    """A submitit executor for `options` (sbatch through SlurmExecutor, or local processes through
    LocalExecutor), writing its scripts and logs to `folder`; `dependency` applies on Slurm (a local job
    runs its stages in order instead)."""
    import submitit  # seconds to import: only a command that submits pays for it

    if options.cluster == "local":
        executor = submitit.LocalExecutor(folder=str(folder), max_num_timeout=options.max_requeues)
        executor.update_parameters(timeout_min=time_limit_minutes(options.time), tasks_per_node=options.tasks,
                                   gpus_per_node=options.gpus_per_node, signal_delay_s=options.signal_delay_s)
        return executor
    executor = submitit.SlurmExecutor(folder=str(folder), max_num_timeout=options.max_requeues)
    executor.update_parameters(**slurm_parameters(options, job_name, dependency))
    return executor


@contextlib.contextmanager
def sbatch_refusal_in_one_line(options: ClusterOptions, folder: Path):
    """Around a submission: sbatch's refusal (no Slurm controller answers, a partition or account it does not
    know...) becomes a LaunchError naming it, not submitit's traceback, and what the failed submission wrote in
    `folder` (its script, the folders made for it) is removed."""
    import submitit  # as in build_executor

    if options.cluster != "slurm":
        yield
        return
    created = next((path for path in reversed([folder, *folder.parents]) if not path.exists()), None)
    before = set(folder.iterdir()) if created is None else set()
    printed, refusal = io.StringIO(), None     # submitit prints sbatch's stderr before raising: it goes in the line
    try:
        with contextlib.redirect_stderr(printed):
            yield
    except (submitit.core.utils.FailedJobError, submitit.core.utils.FailedSubmissionError) as error:
        refusal = " ".join(str(error).split()) or "no message"
    finally:
        if refusal is None:
            sys.stderr.write(printed.getvalue())
    if refusal is not None:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        else:
            for path in set(folder.iterdir()) - before:
                path.unlink(missing_ok=True)
        raise LaunchError(f"--cluster slurm: sbatch refused the job ({refusal}); check that the cluster answers "
                          "(sinfo), or pass --cluster local to run the same job on this machine")


# ============ submitting a job, recorded in RUN_DIR/jobs.jsonl ============

def record_job(run_dir: Path, kind: str, job, options: ClusterOptions, steps: list[Step]) -> dict:
    """Append the submitted job to RUN_DIR/jobs.jsonl and return the entry."""
    entry = {"kind": kind, "job_id": str(job.job_id), "cluster": options.cluster,
             "submitted": time.strftime("%Y-%m-%d %H:%M:%S"), "folder": str(job.paths.folder),
             "stdout": str(job.paths.stdout), "stderr": str(job.paths.stderr),
             "tasks": options.nodes * options.tasks, "commands": [step.describe() for step in steps]}
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "jobs.jsonl"
    # A write cut short (a kill, a full disk) leaves a line without its newline: this entry starts a line of its own.
    torn = path.is_file() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
    with open(path, "a") as jobs:
        jobs.write(("\n" if torn else "") + json.dumps(entry) + "\n")
    return entry


def existing_run(run: str, what: str) -> Path:
    """The run directory a job works on, refused before submitting when it does not exist (a job would wait for
    it, or fail, long after the command returned)."""
    run_dir = Path(run).resolve()
    if not run_dir.is_dir():
        raise LaunchError(f"--run {run}: no such run directory; {what}")
    return run_dir


def report(entry: dict, run_dir: Path) -> None:
    print(f"submitted {entry['kind']} job {entry['job_id']} ({entry['cluster']}, {entry['tasks']} task(s))\n"
          f"  logs:    {entry['stdout']}\n           {entry['stderr']}\n"
          f"  run dir: {run_dir}", flush=True)


def submit(options: ClusterOptions, run_dir: Path, kind: str, steps: list[Step], dependency: str | None = None,
           announce: bool = True):
    """Submit `steps` as one job for `run_dir` (its scripts and logs in RUN_DIR/jobs), record it in
    RUN_DIR/jobs.jsonl, and print its id, logs and run directory (`announce`; a search prints one line per trial)."""
    executor = build_executor(options, run_dir / "jobs", run_dir.name, dependency)
    with sbatch_refusal_in_one_line(options, run_dir / "jobs"):
        job = executor.submit(StageJob(steps, options.max_requeues, str(run_dir), time_limit_minutes(options.time)))
    entry = record_job(run_dir, kind, job, options, steps)
    if announce:
        report(entry, run_dir)
    return job


def submit_array(options: ClusterOptions, folder: Path, name: str, kind: str, runs: list[tuple[Path, list[Step]]],
                 parallel: int | None = None, announce: bool = True) -> list:
    """Submit one job per (run_dir, steps) as one Slurm job array (separate processes locally), its scripts and logs
    in `folder`, at most `parallel` running at once (Slurm's `%K`; default: submitit's); each job is recorded in
    its RUN_DIR/jobs.jsonl and, with `announce`, printed."""
    executor = build_executor(options, folder, name)
    if parallel is not None:
        executor.update_parameters(array_parallelism=parallel)
    with sbatch_refusal_in_one_line(options, folder), executor.batch():
        jobs = [executor.submit(StageJob(steps, options.max_requeues, str(run_dir), time_limit_minutes(options.time)))
                for run_dir, steps in runs]
    for (run_dir, steps), job in zip(runs, jobs):
        entry = record_job(run_dir, kind, job, options, steps)
        if announce:
            report(entry, run_dir)
    return jobs
