"""What a launched job runs: one stage's command line (`python -m pretrain ...`, `python -m eval watch ...`) in
every task of a submitit job, with the distributed set-up taken from the job's environment, and a requeue at
the time limit.

The stage code has no Slurm branches: the job sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT from submitit's `JobEnvironment` (Slurm's variables, multi-node included, or the
local executor's) and calls the stage's `main(argv)` in-process, as `torchrun` would have started it. A
single-process step (an evaluation) runs in global rank 0 alone, as a world of one, and the job's environment is
put back after it; the other tasks wait for its exit status (a file in the job folder) before the next step.

Time limit and preemption (submitit's sbatch asks for SIGUSR2 `signal_delay_s` before the time limit):
- every task's training loop takes SIGUSR2 as a stop request (`pretrain.runtime.graceful_stop`): the processes agree on
  it at the next optimizer step, save a checkpoint of that step together, and return 128 + SIGUSR2;
- then global rank 0 requeues the job (`scontrol requeue`; locally, submitit's local controller restarts the
  tasks), unless it reached its time limit `max_requeues` times already or made no progress in this allocation;
  the other tasks exit only once rank 0 has decided (with srun's KillOnBadExit=1 an early exit would kill rank 0
  before its requeue). A SIGUSR2 well before the limit is a preemption (`preempt_send_user_signal`), told apart
  as submitit does (`has_timed_out`: the allocation ran less than min(80%, all but 10 minutes) of --time): it
  is always requeued and not counted against `max_requeues`; neither are node failures or manual requeues;
- the requeued job runs the same command line, which resumes from the newest complete checkpoint. Its
  rendezvous port differs from the previous run's (it includes Slurm's restart count): a stale rendezvous of
  the previous allocation cannot be joined (submitit issue #1613).
- submitit calls `checkpoint()` only on rank 0, inside its own signal handler, where no collective can run; it
  does so here only for a signal that arrives before the stage installed its handler (start-up), and then
  requeues the job unchanged.
- SIGTERM (`scancel`, `scontrol requeue`, preemption after its grace time) stops the stage the same way with a
  checkpoint, without a requeue by the job: Slurm requeues a preempted or requeued job itself, and a
  cancelled job stays cancelled. A checkpoint cut short by SIGKILL is never loaded (pretrain.runtime.checkpoint).
"""
from __future__ import annotations

import hashlib
import importlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Exit status of a stage that stopped on the scheduler's warning after saving a checkpoint.
STOPPED_FOR_TIME_LIMIT = 128 + signal.SIGUSR2
STAGES = {"pretrain": "pretrain.__main__", "eval": "eval.__main__", "transfer": "transfer.__main__"}
LOCAL_REQUEUE_EXIT = 144          # submitit's local controller restarts a job whose task exits with this
PENDING_STOP_SIGNAL = "HARDVIEW_PENDING_STOP_SIGNAL"    # read by pretrain.runtime.graceful_stop.GracefulStop
JOB_STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)     # the scheduler's time-limit warning and its stop


# Rendezvous ports come from below Linux's ephemeral range (net.ipv4.ip_local_port_range, 32768-60999 by default),
# where every outgoing connection's own port is drawn: gloo's and the TCP store's connections, Slurm's. A port drawn
# there can be held by one of them: a requeued pretraining's store found its port 45214 taken (EADDRINUSE) beside a
# 2-task job on one machine, and the job died.
RENDEZVOUS_PORTS = range(20000, 32768)


def rendezvous_port(job_id: str, restart_count: int) -> int:
    """A port in RENDEZVOUS_PORTS that every task of one run of a job computes alike; another run (a requeue)
    or another job gets another port."""
    digest = hashlib.sha256(f"{job_id}/{restart_count}".encode()).digest()
    return RENDEZVOUS_PORTS.start + int.from_bytes(digest[:4], "big") % len(RENDEZVOUS_PORTS)


def distributed_environment(job_env, restart_count: int, local: bool) -> dict[str, str]:
    """torch.distributed's environment variables for this task, from submitit's JobEnvironment.

    The master is the first node of the job (Slurm's SLURM_JOB_NODELIST, compressed lists such as node[01-02]
    expanded by submitit); a local job's is this machine.
    """
    tasks_per_node = job_env.num_tasks // max(job_env.num_nodes, 1)
    return {"RANK": str(job_env.global_rank), "WORLD_SIZE": str(job_env.num_tasks),
            "LOCAL_RANK": str(job_env.local_rank), "LOCAL_WORLD_SIZE": str(tasks_per_node),
            "MASTER_ADDR": "127.0.0.1" if local else job_env.hostnames[0],
            "MASTER_PORT": str(rendezvous_port(job_env.job_id, restart_count))}


def restart_count(job_env, folder: Path) -> int:
    """How many times this job has been requeued, for any reason (it makes each allocation's rendezvous port):
    Slurm's count, or, for a local job, the requeues its rank 0 recorded in JOB_FOLDER/<job id>.requeues. Only
    time limits count against --max-requeues (`time_limit_requeues`)."""
    if job_env.cluster != "local":
        return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    record = folder / f"{job_env.job_id}.requeues"
    return len([line for line in record.read_text().splitlines() if line.strip()]) if record.is_file() else 0


def hold_stop_signals() -> None:
    """Until the stage's training loop takes over signals (pretrain.runtime.graceful_stop), record a SIGUSR2 (time-limit
    warning) or SIGTERM in PENDING_STOP_SIGNAL instead of letting submitit requeue a job that has not started
    or let it die: the stage then stops, with a checkpoint, after its first optimizer step."""
    def record(signum: int, frame) -> None:
        os.environ.setdefault(PENDING_STOP_SIGNAL, str(signum))

    for signum in JOB_STOP_SIGNALS:
        signal.signal(signum, record)


def ignore_stop_signals_once_done() -> None:
    """Every step has finished and written its results: a time-limit warning or SIGTERM from now on must not turn
    the finished job into a failed one. A Python handler is not enough: CPython puts the default action (death)
    back for every Python-level handler while the interpreter shuts down, after submitit has written the job's
    result, and a warning landing there killed a completed fine-tuning job (CI: "task 0: User defined signal 2"
    after "Exiting after successful completion"). Ignored signals stay ignored to the end; the scheduler's SIGKILL
    still ends the job when it must."""
    for signum in JOB_STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


@dataclass
class Step:
    """One stage command line of a job: `python -m <STAGES[stage]> <argv>`, in every task (`distributed`: a
    DeepSpeed stage) or in global rank 0 alone (evaluation and the single-process transfer stages)."""

    stage: str
    argv: list[str]
    distributed: bool = True

    def describe(self) -> str:
        return f"python -m {STAGES[self.stage].split('.')[0]} {' '.join(self.argv)}"


def run_on_rank_zero(step: Step, status_file: Path, port: int) -> int:
    """Run a single-process step in global rank 0 as a world of one (its own rendezvous port), then put the job's
    environment back (the next distributed step runs on every task, with the job's world) and record the step's
    exit status in `status_file` for the other tasks, which wait for it (`wait_for_step_status`)."""
    saved = dict(os.environ)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_PORT=str(port))
    status = 1                                 # an exception is a failed step for the waiting tasks too
    try:
        status = importlib.import_module(STAGES[step.stage]).main(list(step.argv))
        return status
    finally:
        os.environ.clear()
        os.environ.update(saved)
        tmp = status_file.with_name(status_file.name + ".tmp")
        tmp.write_text(str(status))
        os.replace(tmp, status_file)


def wait_for_file(path: Path, timeout_s: float, poll_seconds: float = 1.0) -> bool:
    """Wait until `path` exists (True) or `timeout_s` has passed (False)."""
    deadline = time.time() + timeout_s
    while not path.is_file():
        if time.time() > deadline:
            return False
        time.sleep(poll_seconds)
    return True


def time_limit_requeues(folder: Path, job_id: str) -> int:
    """How many times this job was requeued at its time limit (rank 0 records each in JOB_FOLDER/<id>.timeouts):
    preemptions, node failures and manual requeues are not counted against --max-requeues."""
    record = folder / f"{job_id}.timeouts"
    return len([line for line in record.read_text().splitlines() if line.strip()]) if record.is_file() else 0


def wait_for_step_status(status_file: Path, poll_seconds: float = 1.0) -> int:
    """The exit status rank 0 recorded for a single-process step (a barrier between the job's steps: a task must
    not start the next distributed step, or exit, before rank 0 has finished this one)."""
    while not status_file.is_file():
        time.sleep(poll_seconds)
    return int(status_file.read_text())


@dataclass
class StageJob:
    """A job (pickled by submitit) that runs its steps in order in each of its tasks."""

    steps: list[Step]
    max_requeues: int = 10
    run_dir: str | None = None              # where progress is read, to refuse a requeue without progress
    time_limit_min: int | None = None       # the job's --time: tells a time limit from a preemption

    def __call__(self) -> int:
        import submitit

        started = time.time()
        hold_stop_signals()
        job_env = submitit.JobEnvironment()
        local = job_env.cluster == "local"
        restarts = restart_count(job_env, job_env.paths.folder)
        os.environ.update(distributed_environment(job_env, restarts, local))
        started_at = self.progress()
        for index, step in enumerate(self.steps):
            done = job_env.paths.folder / f"{job_env.job_id}.run{restarts}.step{index}.status"
            if not step.distributed and job_env.global_rank != 0:
                status = wait_for_step_status(done)     # rank 0 runs it alone; the others wait for its outcome
            elif not step.distributed:
                status = run_on_rank_zero(step, done, rendezvous_port(job_env.job_id + "/rank0", restarts))
            else:
                status = importlib.import_module(STAGES[step.stage]).main(list(step.argv))
            if status == STOPPED_FOR_TIME_LIMIT:
                decided = job_env.paths.folder / f"{job_env.job_id}.run{restarts}.requeue_decided"
                if job_env.global_rank == 0:
                    try:
                        self.requeue(job_env, started_at, timed_out=self.timed_out(started),
                                     needs_progress=step.stage != "eval")
                    finally:
                        decided.touch()
                else:       # no task exits before rank 0 has requeued (srun's KillOnBadExit would kill rank 0)
                    wait_for_file(decided, timeout_s=300)
                raise SystemExit(status)        # no result file: the job is not over
            if status > 128:                    # stopped on SIGTERM / SIGINT after a checkpoint
                raise SystemExit(status)
            if status != 0:
                raise RuntimeError(f"{step.describe()} exited with status {status}; see the messages above")
        ignore_stop_signals_once_done()
        return 0

    def progress(self) -> dict[str, int]:
        """The newest complete checkpoint's step of every training stage of the run: pretraining's
        (RUN_DIR/checkpoints) and those of the fine-tuning and detection runs under it (RUN_DIR/finetune/*/,
        RUN_DIR/detection/*/), by directory; {} without a run directory. A fine-tuning job's progress is its own."""
        if self.run_dir is None:
            return {}
        from pretrain.runtime.checkpoint import complete_checkpoints

        run_dir = Path(self.run_dir)
        steps = {}
        for directory in [run_dir / "checkpoints", *sorted(run_dir.glob("finetune/*/checkpoints")),
                          *sorted(run_dir.glob("detection/*/checkpoints"))]:
            newest = complete_checkpoints(directory)
            if newest:
                steps[str(directory.parent.relative_to(run_dir)) or "."] = int(newest[0].name.removeprefix("step"))
        return steps

    def timed_out(self, started: float) -> bool:
        """Whether the stop signal came at the time limit rather than from a preemption, as submitit decides it
        (`JobEnvironment.has_timed_out`): the allocation has run min(80%, all but 10 minutes) of --time."""
        if self.time_limit_min is None:
            return True
        limit_s = self.time_limit_min * 60
        return time.time() - started >= min(0.8 * limit_s, limit_s - 600)

    def requeue(self, job_env, started_at: dict[str, int], timed_out: bool, needs_progress: bool = True) -> None:
        """Rank 0, after every task saved the checkpoint: put the job back in the queue. A time limit counts
        against --max-requeues and, for a training step (`needs_progress`; not the watcher, which follows a run
        that may be waiting in the queue), needs progress in this allocation; a preemption is always requeued."""
        folder = job_env.paths.folder
        progress = self.progress()
        now_at = ", ".join(f"{step}" + (f" of {name}" if name != "." else "") for name, step in progress.items())
        now_at = now_at or "none"
        timeouts = time_limit_requeues(folder, job_env.job_id)
        if timed_out and timeouts >= self.max_requeues:
            print(f"launch: not requeued: the job reached its time limit {timeouts + 1} times (max_requeues="
                  f"{self.max_requeues}); the checkpoint of step {now_at} is saved: submit the same command again "
                  "to continue", file=sys.stderr, flush=True)
            return
        if timed_out and needs_progress and self.run_dir is not None and progress == started_at:
            print(f"launch: not requeued: no optimizer step was taken in this allocation (still at step {now_at}); "
                  "raise --time or --signal-delay-s", file=sys.stderr, flush=True)
            return
        if timed_out:
            with open(folder / f"{job_env.job_id}.timeouts", "a") as record:
                record.write(f"{now_at}\n")
            print(f"launch: time limit: checkpoint of step {now_at} saved; requeueing job {job_env.job_id} "
                  f"(requeue {timeouts + 1} of at most {self.max_requeues})", file=sys.stderr, flush=True)
        else:
            print(f"launch: preempted: checkpoint of step {now_at} saved; requeueing job {job_env.job_id} (not "
                  "counted against --max-requeues)", file=sys.stderr, flush=True)
        if job_env.cluster == "local":
            with open(folder / f"{job_env.job_id}.requeues", "a") as record:
                record.write(f"{now_at}\n")
            raise SystemExit(LOCAL_REQUEUE_EXIT)
        requeued = subprocess.run(["scontrol", "requeue", job_env.job_id], capture_output=True, text=True, timeout=60)
        if requeued.returncode != 0:    # a preempted job that Slurm requeues itself (PreemptMode=REQUEUE) is pending
            print(f"launch: scontrol requeue {job_env.job_id}: {requeued.stderr.strip() or requeued.returncode} "
                  f"(Slurm may already have requeued it)", file=sys.stderr, flush=True)

    def checkpoint(self, *args, **kwargs):
        """submitit, on rank 0, for a SIGUSR2 that arrived before the stage handled signals: requeue as is."""
        import submitit

        return submitit.helpers.DelayedSubmission(self)
