"""`python -m launch` against a real Slurm scheduler, started on this machine by the tests (tests/slurm_cluster.py,
which first installs slurm-wlm and munge with apt-get where they are missing):

- a 2-process pretraining job hits its time limit (its warning), saves a checkpoint of the step it was taking, requeues
  itself and resumes at exactly that step; `scontrol requeue` (SIGTERM, then SIGKILL after KillWait) makes it
  resume from its newest complete checkpoint; it finishes with each step logged once and every lr the
  schedule's value; side by side, a USR2 from Slurm (what a preemption delivers, and submitit's --signal before
  the time limit) to three more jobs: a pretraining long before its time limit is preempted, requeued though no
  time-limit requeue is left, and resumes where it stopped; its checkpoint-watching evaluation and a fine-tuning
  job, each stopped as at its time limit, requeue too: the watcher evaluates every export exactly once, the
  fine-tuning resumes at its own checkpoint and logs every step once;
- a sweep of two runs is one job array, and `launch status` reads both;
- a pipeline's final evaluation starts only after pretraining succeeded (and never when it failed: Slurm cancels
  it, and the watcher stops by itself);
- `--time` in every form Slurm accepts means the minutes Slurm gives the job.
"""
import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from pretrain.export import published_export_steps
from tests import forked_runs
from tests.run_helpers import hand_computed_lr
from tests.machine_speed import scaled, slowness
from tests.slurm_cluster import SlurmCluster, scontrol_job
from tests.test_finetune import CONFIG as FINETUNE_CONFIG, write_export

pytestmark = pytest.mark.slurm         # starts a real Slurm cluster on this machine (tests/slurm_cluster.py)

ROOT = Path(__file__).parents[1]
CONFIG = ROOT / "configs/pretrain/simclr_digits.yaml"
TINY = ["data.batch_size=32", "data.num_workers=1", "model.proj_hidden_dim=64", "model.proj_out_dim=32",
        "engine.image_grid_every_steps=0", "engine.log_every_steps=1"]   # the tests count every step's line
SLURM = ["--cluster", "slurm", "--cpus-per-task", "1"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # 6 one-core slots on this 2-core machine, for jobs that mostly wait, side by side: the stop-signal test's four
    # jobs (five tasks); the two pipelines.
    with SlurmCluster(tmp_path_factory.mktemp("slurm"), cpus=6) as running:
        yield running


def launch(*args: str, timeout: int = 180):
    """`python -m launch ARGS`, forked from a server that imported torch (tests/forked_runs.py); the jobs it
    submits run in Slurm's own processes."""
    return forked_runs.run("launch", list(args), timeout=timeout)


def data(digits: Path) -> list[str]:
    return [f"data.train={digits / 'train.beton'}", f"data.val={digits / 'val.beton'}"]


def submitted(stdout: str) -> list[str]:
    return re.findall(r"submitted \S+ job (\S+)", stdout)



ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def wait_until(condition, what, timeout: float = 400, job: str | None = None, log: Path | None = None) -> None:
    """Poll `condition()` until it holds, at most `timeout` s on the reference CPU (tests/machine_speed.py); with
    `job`, fail at once when that job has ended (Slurm's state) and the condition still does not hold. A failure
    names `what` (a string, or a function giving one then), the job's state, and ends with the last lines of `log`
    (its stderr, say)."""
    deadline = time.time() + scaled(timeout)
    describe = what if callable(what) else lambda: what

    def failure(reason: str) -> str:
        state = f"; job {job}: {scontrol_job(job)}" if job is not None else ""
        tail = f"\n--- the end of {log}:\n" + log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
        return f"{reason}{state}{tail}"

    while not condition():
        assert time.time() < deadline, failure(f"timed out after {scaled(timeout):.0f} s waiting for {describe()}")
        state = scontrol_job(job)["JobState"] if job is not None else None
        if state in ENDED and not condition():
            raise AssertionError(failure(f"job {job} ended ({state}) before {describe()}"))
        time.sleep(0.5)


def logged(run_dir: Path) -> list[dict]:
    metrics = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


def job_logs(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "jobs").glob("*_log.*")))


def slurm_minutes(limit: str) -> int:
    """Minutes of a TimeLimit as `scontrol show job` prints it: [D-]HH:MM:SS or MM:SS."""
    days, _, clock = limit.rpartition("-")
    fields = [int(field) for field in clock.split(":")]
    hours, minutes, seconds = ([0] * (3 - len(fields)) + fields)
    return int(days or 0) * 1440 + hours * 60 + minutes + (seconds > 0)


@pytest.mark.parametrize("limit", ["90", "0:30", "5:30", "2:00:00", "1-12", "1-12:30", "1-12:30:45", "3-0"])
def test_every_time_limit_form_means_what_slurm_makes_of_it_on_a_real_slurm_cluster(cluster, limit):
    """launch's minutes (the signal delay is checked against them) against the TimeLimit Slurm gives a held job."""
    from launch.cluster import time_limit_minutes

    submitted_job = subprocess.run(["sbatch", "--hold", "--parsable", f"--time={limit}", "--wrap", "true"],
                                   capture_output=True, text=True, check=True).stdout.strip()
    try:
        assert time_limit_minutes(limit) == slurm_minutes(scontrol_job(submitted_job)["TimeLimit"])
    finally:
        subprocess.run(["scancel", submitted_job], check=False)


def stop_with_usr2(job: str) -> None:
    """Slurm's USR2 to every task of the job, as a preemption (preempt_send_user_signal) or the time-limit warning
    of submitit's --signal delivers it."""
    subprocess.run(["scancel", "--signal", "USR2", job], check=True)


def requeue(job: str) -> None:
    """`scontrol requeue`, what an admin or a preemption with PreemptMode=REQUEUE does: SIGTERM, then SIGKILL after
    KillWait, and the job back in the queue."""
    subprocess.run(["scontrol", "requeue", job], check=True)


def job_log(run_dir: Path, job: str, stream: str = "out") -> str:
    path = run_dir / "jobs" / f"{job}_0_log.{stream}"
    return path.read_text(errors="replace") if path.exists() else ""


def test_every_kind_of_job_outlives_time_limits_preemptions_and_requeues_on_a_real_slurm_cluster(
        cluster, digits, few_digits, tmp_path):
    """Four jobs side by side (they mostly wait for Slurm's signals and requeues, so together they take about the
    time of the longest):

    A. a 2-task pretraining meets its real time limit: SIGUSR2 before it, a checkpoint of the step it was taking, a
       requeue, a resume at exactly that step; then `scontrol requeue` (SIGTERM): it resumes from its newest
       complete checkpoint, and ends with each step logged once and every lr the schedule's value;
    B. a pretraining preempted (USR2 minutes before its 15-minute limit) is requeued though --max-requeues 0 allows
       no time-limit requeue, is not counted as one, and logs each step once;
    C. its checkpoint-watching evaluation, stopped as at its time limit, is requeued and evaluates every export
       exactly once over its allocations;
    D. a fine-tuning job stopped as at its time limit requeues from its own checkpoint and logs every step once.
    """
    # A. Slurm sends the --signal warning up to 30 s earlier than asked (it checks time limits every 30 s), so each
    # 2-minute allocation is warned 85-115 s in, 5 s before the limit at the latest. The schedule's 330 steps (15
    # epochs: tests/run_helpers.py, hand_computed_lr) take longer than that on the reference CPU (about 3.3 steps/s
    # after a 7-s start-up on an idle machine; 132 steps before the warning beside the suite's two pytest workers);
    # later allocations share the rest, each warned the same way. A slower machine takes fewer steps per allocation:
    # 400 / its factor, at least 40, at most the schedule's 330, with requeues enough for its slowest allocations (at
    # the factor 7.40 of a slow CPU modelled on the reference one, tests/slow_cpu.py, the first allocation trained 20
    # steps: 400 / 7.40 = 54 keeps the reference CPU's margin of about 2.5 times what the first allocation takes,
    # where the earlier floor of 80 took a fourth allocation). (1-minute allocations were too short beside two
    # pytest workers on an AVX2-only EPYC: the 2-task job's start-up took 49 s, the warning came before its first
    # step, and Slurm ended the job, TIMEOUT, before that step's checkpoint.)
    limited, stop = tmp_path / "limited", min(330, max(40, round(400 / slowness())))
    [time_limited] = submitted(launch(
        "pretrain", "--config", str(CONFIG), *TINY, *data(digits), f"run_dir={limited}", f"engine.max_steps={stop}",
        "engine.checkpoint_every_steps=1000", "optim.warmup_epochs=0.5", *SLURM, "--tasks-per-node", "2",
        "--time", "2", "--signal-delay-s", "5", "--max-requeues", "30").stdout)
    # B, C, D
    run_dir, finetuned = tmp_path / "run", tmp_path / "finetuned"
    write_export(finetuned, digits)                         # a backbone to fine-tune (random: the job is the test)
    steps, export_steps = 30, [10, 20, 30]
    [pretraining] = submitted(launch(        # a quarter of the digits: the watcher's every k-NN costs a quarter
        "pretrain", "--config", str(CONFIG), *TINY, *data(few_digits), f"run_dir={run_dir}",
        f"engine.max_steps={steps}", "engine.checkpoint_every_steps=10", *SLURM, "--time", "15",
        "--max-requeues", "0").stdout)
    [watcher] = submitted(launch("eval-watch", "--run", str(run_dir), "--protocols", "knn", "--poll-seconds", "1",
                                 *SLURM, "--time", "2", "--signal-delay-s", "5").stdout)
    [finetuning] = submitted(launch("finetune", "--run", str(finetuned), "--config", str(FINETUNE_CONFIG),
                                    "optim.epochs=6", "engine.print_every_steps=1", "engine.log_every_steps=1",
                                    *SLURM, "--time", "2", "--signal-delay-s", "5",     # requeues enough for a
                                    "--max-requeues", str(max(3, round(slowness())))).stdout)  # slow machine's
    finetune_metrics = lambda: [json.loads(line) for path in finetuned.glob("finetune/*/metrics.jsonl")  # noqa: E731
                                for line in path.read_text().splitlines()]

    def time_limit_stop() -> int | None:
        stopped = re.search(r"time limit: checkpoint of step (\d+) saved", job_logs(limited))
        return int(stopped.group(1)) if stopped else None

    # Each job is stopped once, as soon as it is there: A by `scontrol requeue` once it trains again after its
    # time-limit requeue; B after a few steps (a preemption: minutes before its limit); C after its first
    # evaluation, D after a few steps: a stop in their first 10 minutes counts as their time limit (2 minutes:
    # submitit's rule, min(80%, all but 10 minutes)); the watcher may meet its real one too while it waits. Each
    # allocation's 2 minutes leave room after a start-up on a busy machine (a 1-minute watcher beside two pytest
    # workers was warned before its first evaluation in each of 5 allocations).
    ready = {time_limited: lambda: time_limit_stop() is not None and any(
                 line["step"] > time_limit_stop() for line in logged(limited)),
             pretraining: lambda: any(line["step"] >= 4 for line in logged(run_dir)),
             watcher: lambda: (run_dir / "eval/knn_step0000010.json").is_file(),
             finetuning: lambda: any(line["step"] >= 3 for line in finetune_metrics())}

    saved_checkpoint = {}

    def check_the_checkpoint_then_requeue(job: str) -> None:
        # (later stops rotate the time limit's checkpoint away: it is looked at now)
        saved_checkpoint["found"] = (limited / f"checkpoints/step{time_limit_stop():08d}/trainer_state.json").is_file()
        requeue(job)

    names = {time_limited: ("A, the time-limited pretraining", limited), pretraining: ("B, the preempted pretraining",
             run_dir), watcher: ("C, its watcher", run_dir), finetuning: ("D, the fine-tuning", finetuned)}

    def stop_the_ready_ones() -> bool:
        for job in [job for job, condition in ready.items() if condition()]:
            (check_the_checkpoint_then_requeue if job == time_limited else stop_with_usr2)(job)
            del ready[job]
        # A job ended before its stop, or failed after it (a requeue that could not start: the watcher would wait
        # for B's exports to the end of the wait), fails the test at once, naming the job and its log's end.
        ended = {job: cluster.job_state(job) for job in names}
        ended = {job: state for job, state in ended.items()
                 if state in ENDED and (job in ready or state != "COMPLETED")}
        assert not ended, "\n".join(
            f"{names[job][0]} (job {job}) ended {state}{' before it could be stopped' if job in ready else ''}; "
            f"the end of its log:\n{job_log(names[job][1], job, 'err')[-2000:]}" for job, state in ended.items())
        return not ready

    wait_until(stop_the_ready_ones, lambda: f"each job's stop (not yet: {', '.join(names[job][0] for job in ready)})")

    # B. The preemption is requeued though --max-requeues 0 allows no time-limit requeue, and is not counted.
    wait_until(lambda: (run_dir / "finished.json").is_file(), "the end of the pretraining", job=pretraining)
    assert "preempted: checkpoint of step" in job_log(run_dir, pretraining, "err")
    assert "not requeued" not in job_log(run_dir, pretraining, "err")
    assert not (run_dir / "jobs" / f"{pretraining}.timeouts").exists() and cluster.restart_count(pretraining) >= 1
    assert [line["step"] for line in logged(run_dir)] == list(range(1, steps + 1))       # each step once
    # C. The watcher at its time limit: requeued, and every export evaluated exactly once over its allocations.
    wait_until(lambda: cluster.job_state(watcher) == "COMPLETED", "the watcher's end", job=watcher,
               log=run_dir / "jobs" / f"{watcher}_0_log.err")
    assert f"requeueing job {watcher}" in job_log(run_dir, watcher, "err")
    # (an evaluation the stop cut short is started again: each is completed, its result written, once)
    exports = published_export_steps(run_dir)              # every 10 steps, and the preemption's checkpoint
    assert set(export_steps) < set(exports)
    evaluated = re.findall(r"results: \S+/knn_step(\d+)\.json", job_log(run_dir, watcher))
    assert sorted(map(int, evaluated)) == exports, job_log(run_dir, watcher)
    assert sorted(p.name for p in (run_dir / "eval").glob("knn_step*.json")) == [
        f"knn_step{step:07d}.json" for step in exports]
    # D. The fine-tuning at its time limit: its progress is its own checkpoint (RUN_DIR/finetune/...), so it is
    # requeued, resumes there and ends with every step logged once.
    wait_until(lambda: cluster.job_state(finetuning) == "COMPLETED", "the fine-tuning's end", timeout=300,
               job=finetuning, log=finetuned / "jobs" / f"{finetuning}_0_log.err")
    stopped = job_log(finetuned, finetuning, "err")
    assert re.search(rf"time limit: checkpoint of step \d+ of finetune/\S+ saved; requeueing job {finetuning}", stopped)
    finetune_steps = [line["step"] for line in finetune_metrics()]
    assert finetune_steps == list(range(1, len(finetune_steps) + 1)) and len(finetune_steps) == 6 * 4
    assert len(list(finetuned.glob("eval/finetune_10pct_export_step*.json"))) == 1

    # A. The time limit: a checkpoint of the step taken at the warning, a requeue, a resume there (zero steps lost).
    saved = time_limit_stop()
    assert saved_checkpoint["found"]
    assert f"resumed {limited} at step {saved} " in job_logs(limited)
    wait_until(lambda: (limited / "finished.json").is_file(), "the end of the time-limited run", timeout=500,
               job=time_limited)
    assert "DUE TO JOB REQUEUE" in job_logs(limited)              # the scontrol requeue's SIGTERM
    assert cluster.restart_count(time_limited) >= 2
    # Every allocation resumed at exactly the step the one before stopped at (each stop, on USR2 at the time
    # limit or on the requeue's SIGTERM, reports its step only once its checkpoint is complete): zero steps lost.
    # Rank 0 writes "resumed" to task 0's stdout and its stop report to task 0's stderr, each in order.
    task0 = limited / "jobs" / f"{time_limited}_0_log"
    resumes = [int(step) for step in
               re.findall(rf"resumed {re.escape(str(limited))} at step (\d+) ", Path(f"{task0}.out").read_text())]
    stops = [int(step) for step in
             re.findall(r"\[rank 0\] stopped on a signal after step (\d+)", Path(f"{task0}.err").read_text())]
    assert len(stops) >= 2 and resumes == stops, job_logs(limited)[-4000:]
    lines = logged(limited)
    assert [line["step"] for line in lines] == list(range(1, stop + 1))       # each step once, none lost
    for line in lines:
        assert line["train/lr"] == pytest.approx(hand_computed_lr(line["step"] - 1), rel=1e-9, abs=1e-12)
    assert json.loads((limited / "finished.json").read_text())["step"] == stop
    # For the README: seconds from the last step before the time-limit stop to the first step after it.
    times = {line["step"]: line["time"] for line in lines}
    print(f"time-limit requeue: stopped after step {saved}; training again {times[saved + 1] - times[saved]:.1f} s later")


def test_a_sweep_is_one_job_array_and_status_reads_every_run_on_a_real_slurm_cluster(cluster, digits, tmp_path):
    sweep_dir = tmp_path / "sweep"
    result = launch("pretrain", "--config", str(CONFIG), *TINY, *data(digits), "name=tiny", "engine.max_steps=3",
                    *SLURM, "--time", "10", "--sweep", "optim.lr=0.1,0.2", "--sweep-dir", str(sweep_dir))
    jobs = submitted(result.stdout)
    assert len(jobs) == 2 and len({job.split("_")[0] for job in jobs}) == 1    # array ID_0 and ID_1
    runs = [sweep_dir / "tiny_lr0.1", sweep_dir / "tiny_lr0.2"]
    wait_until(lambda: all((run / "finished.json").is_file() for run in runs), "both runs of the sweep")
    # a run's finished.json comes a moment before its job ends
    wait_until(lambda: all(cluster.job_state(job) == "COMPLETED" for job in jobs), "both jobs to end")
    from pretrain.config import load_config
    assert [load_config(run / "config.yaml").optim.lr for run in runs] == [0.1, 0.2]
    status = launch("status", str(sweep_dir)).stdout.splitlines()
    assert [row.split()[0] for row in status[1:]] == ["tiny_lr0.1", "tiny_lr0.2"]
    for row, job in zip(status[1:], jobs):
        assert f"pretrain {job}" in row and "3 (done)" in row and "COMPLETED" in row


def test_pipeline_evaluates_only_after_pretraining_succeeded_on_a_real_slurm_cluster(cluster, few_digits, tmp_path):
    run_dir, broken = tmp_path / "run", tmp_path / "broken"
    result = launch("pipeline", "--config", str(CONFIG), *TINY, *data(few_digits), f"run_dir={run_dir}",
                    "engine.max_steps=4", "engine.checkpoint_every_steps=2", "--watch-protocols", "knn",
                    "--final-protocols", "knn,linear", "--watch-poll-seconds", "3", *SLURM, "--time", "10")
    pretraining, watcher, final = submitted(result.stdout)
    # Side by side, a pipeline whose pretraining fails: its final evaluation must never start.
    result = launch("pipeline", "--config", str(CONFIG), *TINY, f"data.train={tmp_path / 'missing.beton'}",
                    f"run_dir={broken}", "--watch-poll-seconds", "3", *SLURM, "--time", "10")
    failed, failed_watcher, failed_final = submitted(result.stdout)

    kinds = [json.loads(line)["kind"] for line in (run_dir / "jobs.jsonl").read_text().splitlines()]
    assert kinds == ["pretrain", "eval-watch", "final-eval"]
    assert scontrol_job(final)["Dependency"] == f"afterok:{pretraining}(unfulfilled)" or \
        scontrol_job(final)["JobState"] in ("RUNNING", "COMPLETED")
    wait_until(lambda: (run_dir / "eval/linear_step0000004.json").is_file(), "the final linear probe", job=final)
    wait_until(lambda: cluster.job_state(final) == "COMPLETED", "the final evaluation job")
    assert scontrol_job(final)["StartTime"] >= scontrol_job(pretraining)["EndTime"]   # only after pretraining
    wait_until(lambda: cluster.job_state(watcher) == "COMPLETED", "the watcher")
    assert sorted(p.name for p in (run_dir / "eval").glob("knn_step*.json")) == \
        ["knn_step0000002.json", "knn_step0000004.json"]                      # the watcher's, each checkpoint

    # The failed pretraining: Slurm cancels the final job (kill-on-invalid-dep) and the watcher stops by itself,
    # naming the job: neither waits out its time limit.
    wait_until(lambda: cluster.job_state(failed) == "FAILED", "the failed pretraining")
    wait_until(lambda: cluster.job_state(failed_final) == "CANCELLED", "the final job's cancellation")
    assert not (broken / "jobs" / f"{failed_final}_0_log.out").exists()           # it never ran
    wait_until(lambda: cluster.job_state(failed_watcher) == "FAILED", "the watcher's stop")
    watcher_log = (broken / "jobs" / f"{failed_watcher}_0_log.err").read_text()
    assert f"the pretraining job {failed} has ended (FAILED) without finishing" in watcher_log
