"""The launcher's pure parts: the distributed environment a job derives from Slurm's variables (2 nodes x 2
tasks, a compressed host list), rendezvous ports, sweeps, presets and flags, time limits, the sbatch script, the
status table; and what a user sees where Slurm is missing or does not answer.

None of these needs Slurm (CI's machines have none): the sbatch script is rendered by submitit's own function from
`slurm_parameters`, and a Slurm whose controller does not answer is an `sbatch` on PATH that fails as sbatch then
does. The real-Slurm tests are tests/test_launch_slurm.py."""
import json
import os
import time
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest

from launch.cluster import LaunchError, cluster_options, time_limit_minutes
from launch.jobs import distributed_environment, rendezvous_port
from launch.status import status_table
from launch.sweep import run_name, sweep_combinations

ROOT = Path(__file__).parents[1]
CONFIG = str(ROOT / "configs/pretrain/simclr_digits.yaml")


def put_on_path(monkeypatch, folder: Path, **scripts: str) -> None:
    """Shell scripts named after the keys, in `folder`, first on PATH (real executables that subprocess and
    shutil.which find, as they find Slurm's)."""
    folder.mkdir(exist_ok=True)
    for name, script in scripts.items():
        (folder / name).write_text(f"#!/bin/sh\n{script}\n")
        (folder / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")


@pytest.fixture
def slurm_without_controller(tmp_path, monkeypatch):
    """sbatch and srun on PATH as on a login node whose Slurm controller does not answer: sbatch fails as it does
    then (exit 1, its error on stderr)."""
    put_on_path(monkeypatch, tmp_path / "slurm_bin", srun="exit 1",
                sbatch='echo "sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect '
                       'failure)" >&2; exit 1')


def slurm_task(monkeypatch, node: int, local: int, tasks_per_node: int = 2, nodes: int = 2,
               nodelist: str = "node[01-02]", job: str = "4242") -> None:
    """The variables Slurm sets in one task of an sbatch job on `nodes` nodes x `tasks_per_node` tasks."""
    for key in list(os.environ):
        if key.startswith(("SLURM_", "SUBMITIT_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    monkeypatch.setenv("SLURM_JOB_ID", job)
    monkeypatch.setenv("SLURM_JOB_NODELIST", nodelist)
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", str(nodes))
    monkeypatch.setenv("SLURM_NNODES", str(nodes))
    monkeypatch.setenv("SLURM_NTASKS", str(nodes * tasks_per_node))
    monkeypatch.setenv("SLURM_NODEID", str(node))
    monkeypatch.setenv("SLURM_LOCALID", str(local))
    monkeypatch.setenv("SLURM_PROCID", str(node * tasks_per_node + local))


def test_two_nodes_by_two_tasks_get_ranks_and_one_master_from_slurms_variables(monkeypatch):
    import submitit

    seen = {}
    for node in (0, 1):
        for local in (0, 1):
            slurm_task(monkeypatch, node, local)
            seen[(node, local)] = distributed_environment(submitit.JobEnvironment(), restart_count=0, local=False)
    assert [seen[k]["RANK"] for k in sorted(seen)] == ["0", "1", "2", "3"]
    assert {v["WORLD_SIZE"] for v in seen.values()} == {"4"}
    assert [seen[k]["LOCAL_RANK"] for k in sorted(seen)] == ["0", "1", "0", "1"]
    assert {v["LOCAL_WORLD_SIZE"] for v in seen.values()} == {"2"}
    assert {v["MASTER_ADDR"] for v in seen.values()} == {"node01"}            # the first node of node[01-02]
    assert len({v["MASTER_PORT"] for v in seen.values()}) == 1                 # every task meets at one port


@pytest.mark.parametrize("nodelist, master", [("gpu-a[7,9-10]", "gpu-a7"), ("cn017,cn003", "cn017"),
                                              ("node[001-004]", "node001")])
def test_compressed_host_lists_give_the_first_node(monkeypatch, nodelist, master):
    import submitit

    slurm_task(monkeypatch, 1, 0, nodelist=nodelist)
    assert distributed_environment(submitit.JobEnvironment(), 0, local=False)["MASTER_ADDR"] == master


def test_a_requeued_job_meets_at_another_port():
    # A stale rendezvous of the previous allocation must not be joinable (submitit issue #1613).
    ports = {rendezvous_port("4242", restarts) for restarts in range(20)}
    assert len(ports) == 20
    # and below Linux's ephemeral ports, from which connections take theirs (a requeue's store found 45214 taken)
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports |= {rendezvous_port(f"{job}{rank_zero}", 0) for job in range(2000) for rank_zero in ("", "/rank0")}
    assert all(p < low for p in ports) and len(ports) > 3000
    assert rendezvous_port("4242", 3) == rendezvous_port("4242", 3)
    assert rendezvous_port("4242", 0) != rendezvous_port("4243", 0)


def test_sweep_is_the_product_of_the_values_with_readable_run_names():
    combinations = sweep_combinations(["optim.lr=0.1,0.2,0.4", "method.temperature=0.1,0.2"])
    assert len(combinations) == 6
    assert combinations[0] == ["optim.lr=0.1", "method.temperature=0.1"]
    assert combinations[-1] == ["optim.lr=0.4", "method.temperature=0.2"]
    assert run_name("simclr", combinations[1]) == "simclr_lr0.1_temperature0.2"
    assert run_name("x", ["model.lr=1", "optim.lr=2"]) == "x_model-lr1_optim-lr2"       # same last part
    for bad in (["optim.lr"], ["optim.lr="], ["optim.lr=0.1", "optim.lr=0.2"]):
        with pytest.raises(LaunchError, match="--sweep"):
            sweep_combinations(bad)


def test_time_limits_in_minutes_or_slurm_notation():
    assert time_limit_minutes("90") == 90
    assert time_limit_minutes("2:00:00") == 120
    assert time_limit_minutes("1-00:00:00") == 1440
    assert time_limit_minutes("0:30") == 1
    assert time_limit_minutes("1-12") == 2160            # D-HH: Slurm's day form (was read as 1,452 minutes)
    assert time_limit_minutes("1-12:30") == 2190         # D-HH:MM (was 1,453)
    assert time_limit_minutes("2-0:0:30") == 2881
    with pytest.raises(LaunchError, match="--time 'two hours'"):
        time_limit_minutes("two hours")


@pytest.mark.parametrize("limit", ["0", "0:00", "0-0", "00:00:00"])
def test_a_zero_time_limit_is_refused_by_its_own_name(limit):
    """Slurm reads --time 0 as 'no limit'; it was taken for a 1-minute limit and blamed on --signal-delay-s."""
    with pytest.raises(LaunchError, match=f"--time '{limit}' is Slurm's 'no time limit', but a job .* needs one"):
        cluster_options(options(cluster="local", time=limit))


def options(**given) -> Namespace:
    from dataclasses import fields

    from launch.cluster import ClusterOptions

    values = {f.name: None for f in fields(ClusterOptions)}
    values["sbatch"] = []
    values.update(given)
    return Namespace(**values)


def test_flags_override_the_preset_and_bad_options_are_refused_by_name(tmp_path, slurm_without_controller):
    preset = tmp_path / "cluster.yaml"
    preset.write_text("cluster: slurm\nnodes: 2\ngpus_per_node: 8\npartition: gpu\ntime: '12:00:00'\n"
                      "sbatch: {exclusive: ''}\n")
    chosen = cluster_options(options(preset=str(preset), nodes=4, sbatch=["mail-type=END"]))
    assert (chosen.cluster, chosen.nodes, chosen.gpus_per_node, chosen.tasks, chosen.partition) == \
        ("slurm", 4, 8, 8, "gpu")
    assert chosen.sbatch == {"exclusive": "", "mail-type": "END"}
    assert cluster_options(options(preset="local")).cluster == "local"             # a shipped preset by name

    preset.write_text("nodse: 2\n")
    with pytest.raises(LaunchError, match="unknown option 'nodse'; did you mean 'nodes'"):
        cluster_options(options(preset=str(preset)))
    with pytest.raises(LaunchError, match="--preset 'nowhere'"):
        cluster_options(options(preset="nowhere"))
    with pytest.raises(LaunchError, match="--signal-delay-s 600 must be shorter than the time limit"):
        cluster_options(options(cluster="local", time="5", signal_delay_s=600))
    with pytest.raises(LaunchError, match="--nodes 2 needs --cluster slurm"):
        cluster_options(options(cluster="local", nodes=2))


@pytest.mark.parametrize("argv, named", [
    (["pretrain", "--mem-gb", "-4"], "argument --mem-gb: -4 is not"),
    (["pretrain", "--nodes", "0"], "argument --nodes: 0 is not"),
    (["pretrain", "--gpus-per-node", "1.5"], "argument --gpus-per-node: '1.5' is not"),
    (["finetune", "--run", "R", "--signal-delay-s", "nan"], "argument --signal-delay-s: 'nan' is not"),
    (["pipeline", "--eval-gpus", "3"], "argument --eval-gpus: 3 is not"),
    (["pipeline", "--eval-mem-gb", "0"], "argument --eval-mem-gb: 0 is not"),
    (["pipeline", "--watch-poll-seconds", "-1"], "argument --watch-poll-seconds: -1 is not"),
    (["eval-watch", "--run", "R", "--poll-seconds", "inf"], "argument --poll-seconds: 'inf' is not"),
])
def test_a_bad_number_is_refused_by_its_option_before_the_command_runs(capsys, argv, named):
    """Every numeric option is checked by its argparse type (pretrain/runtime/argument_types.py), in one line;
    `--mem-gb -4` was accepted, and `--eval-watch --poll-seconds inf` reached the job."""
    from launch.__main__ import build_parser

    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err.strip()
    assert refused.value.code == 2 and named in err and len(err.splitlines()) == 1, err


def test_a_presets_numbers_are_checked_as_the_flags_are(tmp_path):
    preset = tmp_path / "cluster.yaml"
    preset.write_text("cluster: local\nmem_gb: -4\n")
    with pytest.raises(LaunchError, match=f"--preset {preset}: mem_gb: -4 is not"):
        cluster_options(options(preset=str(preset)))
    preset.write_text("cluster: local\nnodes: 1\ncpus_per_task: 0\n")
    with pytest.raises(LaunchError, match="cpus_per_task: 0 is not"):
        cluster_options(options(preset=str(preset)))


def test_cluster_slurm_where_slurm_is_not_installed_is_one_line_that_names_cluster_local(tmp_path, monkeypatch,
                                                                                          capsys):
    """As on a machine that never had Slurm: `--cluster slurm` gave submitit's traceback ('Could not detect
    "srun"'); `--cluster auto` with sbatch but no srun chose Slurm and crashed the same way."""
    from launch.__main__ import main

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))          # no sbatch, no srun
    run_dir = tmp_path / "r"
    assert main(["pretrain", "--config", CONFIG, f"run_dir={run_dir}", "--cluster", "slurm"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Slurm was not found here (sbatch and srun not on PATH)" in err and "--cluster local" in err
    assert not run_dir.exists()
    put_on_path(monkeypatch, tmp_path / "bin", sbatch="exit 1")
    assert cluster_options(options(cluster="auto")).cluster == "local"
    with pytest.raises(LaunchError, match="srun not on PATH"):
        cluster_options(options(cluster="slurm"))


def test_sbatch_failing_is_one_line_naming_it_and_the_failed_submission_leaves_nothing(tmp_path, capsys,
                                                                                        slurm_without_controller):
    """No Slurm controller answers: sbatch exits 1. That was submitit's FailedJobError traceback, after sbatch's
    own line; now one line (sbatch's reason, and --cluster local), and no run or sweep directory, script or log."""
    from launch.__main__ import main

    run_dir, sweep_dir, existing = tmp_path / "r", tmp_path / "sweep", tmp_path / "existing"
    existing.mkdir()
    for argv in (["pretrain", "--config", CONFIG, f"run_dir={run_dir}"],
                 ["pretrain", "--config", CONFIG, "--sweep", "optim.lr=0.1,0.2", "--sweep-dir", str(sweep_dir)],
                 ["eval-watch", "--run", str(existing)]):
        assert main([*argv, "--cluster", "slurm"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert "sbatch refused the job (sbatch: error: Batch job submission failed: Unable to contact slurm " \
               "controller (connect failure))" in err and "--cluster local" in err
    assert not run_dir.exists() and not sweep_dir.exists() and list(existing.iterdir()) == []


def test_cli_refuses_a_bad_config_before_submitting_anything(tmp_path):
    from tests import forked_runs

    result = forked_runs.run("launch", ["pretrain", "--config", ROOT / "configs/pretrain/simclr_digits.yaml",
                                        "optim.lr=-1", f"run_dir={tmp_path}/r", "--cluster", "local"], expect=2)
    assert "optim.lr=-1.0 must be a finite number > 0" in result.stderr
    assert not (tmp_path / "r").exists()
    assert "--watch-protocols" in forked_runs.run("launch", ["pipeline", "--help"]).stdout


def test_status_table_reads_jobs_steps_and_latest_evaluations(tmp_path):
    runs = tmp_path / "sweep"
    for name, step in (("a", 7), ("b", 3)):
        run = runs / name
        (run / "eval").mkdir(parents=True)
        (run / "jobs.jsonl").write_text(json.dumps({"kind": "pretrain", "job_id": "999999999", "cluster": "local",
                                                    "folder": str(run / "jobs")}) + "\n")
        (run / "metrics.jsonl").write_text(json.dumps({"step": step, "epoch": 1}) + "\n")
        (run / "eval" / f"knn_step{step:07d}.json").write_text(json.dumps({"step": step, "top1": {"20": 0.5}}))
    (runs / "a" / "finished.json").write_text(json.dumps({"step": 7, "epoch": 2}))
    table = status_table(runs).splitlines()
    assert table[0].split() == ["run", "job", "state", "step", "latest", "evaluation"]
    assert table[1].split()[:5] == ["a", "pretrain", "999999999", "COMPLETED", "7"]
    assert "step 7: knn@k20 50.00%" in table[1]
    assert table[2].split()[:4] == ["b", "pretrain", "999999999", "ENDED"] and "(epoch 1)" in table[2]

    # A pipeline: one row per stage, each its latest job (the pretraining was submitted twice); the step and the
    # evaluation on the run's first row. It used to show the final evaluation's job alone.
    def job(kind, job_id):
        return json.dumps({"kind": kind, "job_id": job_id, "cluster": "local", "folder": str(runs / "c" / "jobs")})
    (runs / "c").mkdir()
    (runs / "c" / "jobs.jsonl").write_text("\n".join([job("pretrain", "999999991"), job("eval-watch", "999999992"),
                                                      job("final-eval", "999999993"), job("pretrain", "999999994")]))
    rows = [line.split() for line in status_table(runs / "c").splitlines()[1:]]
    assert [row[:3] for row in rows] == [["c", "pretrain", "999999994"], ["eval-watch", "999999992", "ENDED"],
                                         ["final-eval", "999999993", "ENDED"]]


def test_a_torn_line_in_jobs_jsonl_is_skipped_with_a_note_and_the_next_record_starts_a_line_of_its_own(
        tmp_path, capsys):
    """A kill or a full disk during record_job tears the last line of RUN_DIR/jobs.jsonl. `launch status` printed a
    JSON error without the file's name and showed nothing; and the next record, appended to the torn line, was
    unreadable too."""
    from launch.__main__ import main
    from launch.cluster import ClusterOptions, record_job

    run = tmp_path / "run"
    run.mkdir()
    job = {"kind": "pretrain", "job_id": "999999991", "cluster": "local", "folder": str(run / "jobs")}
    (run / "jobs.jsonl").write_text(json.dumps(job) + "\n" + json.dumps({**job, "kind": "eval-watch"})[:30])
    assert main(["status", str(run)]) == 0
    shown = capsys.readouterr()
    assert "pretrain 999999991" in shown.out
    assert f"note: {run / 'jobs.jsonl'} line 2 is not a job's record (a write cut short?), skipped" in shown.err
    paths = SimpleNamespace(folder=run / "jobs", stdout=run / "jobs/out", stderr=run / "jobs/err")
    record_job(run, "final-eval", SimpleNamespace(job_id="999999993", paths=paths), ClusterOptions(cluster="local"), [])
    assert main(["status", str(run)]) == 0
    assert "final-eval 999999993" in capsys.readouterr().out


def sbatch_script(options, folder: Path, job_name: str, dependency: str | None = None) -> str:
    """The sbatch script of a job, rendered by submitit's own function (what SlurmExecutor writes) from
    slurm_parameters: no Slurm needed."""
    from submitit.slurm.slurm import _make_sbatch_string

    from launch.cluster import slurm_parameters

    return _make_sbatch_string(command="python -c 1", folder=folder,
                               **slurm_parameters(options, job_name, dependency))


def test_pipeline_evaluation_jobs_have_their_own_resources_and_bare_sbatch_flags_stay_bare(
        tmp_path, slurm_without_controller):
    """The watcher and the final evaluations: one task, a GPU when the training has GPUs, their own memory, cores
    and constraint, never --exclusive (they inherited the training preset's). `--sbatch exclusive=` is written
    `#SBATCH --exclusive` (it was `--exclusive=''`). The script used to come from a SlurmExecutor, which cannot be
    made where Slurm is not installed (`Could not detect "srun"`): CI's machines."""
    from launch.__main__ import build_parser
    from launch.pipeline import evaluation_options
    from launch.cluster import build_executor

    training = cluster_options(options(cluster="slurm", nodes=2, gpus_per_node=8, cpus_per_task=10, mem_gb=500,
                                       constraint="h100", sbatch=["exclusive=", "mail-type=END"]))
    script = sbatch_script(training, tmp_path, "pretrain")
    assert "#SBATCH --exclusive\n" in script and "#SBATCH --mail-type=END" in script
    assert "#SBATCH --constraint=h100" in script and "#SBATCH --mem=512000M" in script
    assert "#SBATCH --requeue" in script and "#SBATCH --time=60" in script and "--dependency" not in script
    # the executor submit() uses writes the same script (srun is on PATH here: a SlurmExecutor can be made)
    executor = build_executor(training, tmp_path, "pretrain")
    assert executor._make_submission_file_text("python -c 1", "uid") == script
    later = sbatch_script(training, tmp_path, "final-eval", dependency="afterok:42")
    assert "#SBATCH --dependency=afterok:42" in later and "#SBATCH --kill-on-invalid-dep=yes" in later

    args = build_parser().parse_args(["pipeline", "--config", "c.yaml"])
    watcher = evaluation_options(training, args)
    assert (watcher.nodes, watcher.tasks, watcher.gpus_per_node, watcher.cpus_per_task) == (1, 1, 1, 10)
    assert watcher.mem_gb is None and watcher.constraint is None and watcher.sbatch == {"mail-type": "END"}
    script = sbatch_script(watcher, tmp_path, "eval-watch")
    assert "--exclusive" not in script and "--constraint" not in script and "--mem" not in script
    args = build_parser().parse_args(["pipeline", "--config", "c.yaml", "--eval-gpus", "0", "--eval-mem-gb", "32",
                                      "--eval-cpus-per-task", "4", "--eval-constraint", "cpu"])
    chosen = evaluation_options(training, args)
    assert (chosen.gpus_per_node, chosen.mem_gb, chosen.cpus_per_task, chosen.constraint) == (0, 32, 4, "cpu")
    cpu_training = cluster_options(options(cluster="slurm"))
    assert evaluation_options(cpu_training, build_parser().parse_args(["pipeline"])).gpus_per_node == 0


@pytest.mark.parametrize("bad, named", [
    (["--transfer", "bogus"], "--transfer 'bogus': bogus is not a transfer stage"),
    (["--watch-protocols", "knn,foo"], "--watch-protocols 'knn,foo': foo is not a protocol"),
    (["--transfer", "finetune", "--finetune-config", "nowhere.yaml"], "nowhere.yaml"),
    (["--finetune-config", "configs/transfer/finetune_digits.yaml"], "--transfer has no finetune"),
])
def test_pipeline_refuses_what_its_jobs_would_fail_on_before_submitting(tmp_path, capsys, bad, named):
    from launch.__main__ import main

    run_dir = tmp_path / "r"
    assert main(["pipeline", "--config", str(ROOT / "configs/pretrain/simclr_digits.yaml"), f"run_dir={run_dir}",
                 "--cluster", "local", *bad]) == 2
    assert named in capsys.readouterr().err and not run_dir.exists()


@pytest.mark.parametrize("argv, named", [
    (["eval-watch", "--run", "{tmp}/missing"], "no such run directory; start the pretraining first"),
    (["eval-watch", "--run", "{tmp}", "--protocols", "knn,foo"], "foo is not a protocol"),
    (["eval-watch", "--run", "{tmp}", "--protocols", "bogus"], "error: --protocols 'bogus': bogus is not a protocol"),
    (["eval-watch", "--run", "{tmp}", "--protocols", ","], "error: --protocols ',' names no protocol"),
    (["finetune", "--run", "{tmp}/missing"], "no such run directory"),
    (["finetune", "--run", "{tmp}", "data.label_fraction=150%"], "label_fraction"),
    (["finetune", "--run", "{tmp}"], "has no backbone.pth yet"),
    (["status", "{tmp}/missing"], "no such directory"),
])
def test_launch_refuses_a_missing_run_or_a_bad_value_before_submitting(tmp_path, capsys, argv, named):
    """`launch eval-watch --run MISSING` used to create the directory and wait forever; `launch finetune` with a
    missing run or a 150% label fraction failed in the job; `launch status MISSING` said 'no runs'."""
    from launch.__main__ import main

    assert main([part.replace("{tmp}", str(tmp_path)) for part in argv] + ["--cluster", "local"] *
                (argv[0] != "status")) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "missing").exists() and not (tmp_path / "jobs.jsonl").exists()


@pytest.mark.slow
def test_a_two_task_job_fine_tunes_on_both_tasks_after_rank_0_evaluated_alone(digits, tmp_path):
    """A job of two tasks (a pipeline's final job): the k-NN of the export on rank 0 alone, then fine-tuning on both.
    Rank 0 used to keep the single-process step's environment (WORLD_SIZE=1, its port) and fine-tune as a world of
    one while rank 1 waited at the job's rendezvous; the other task now waits for rank 0's step, and the job's
    environment is put back. The small ResNet of the engine tests: the job's tasks are the test, not the network."""
    from launch.cluster import submit
    from launch.jobs import Step
    from tests.engine_helpers import SMALL_RESNET
    from tests.test_finetune import write_export

    recipe = tmp_path / "finetune.yaml"
    recipe.write_text((ROOT / "configs/transfer/finetune_digits.yaml").read_text().replace("epochs: 20", "epochs: 1"))
    run_dir = tmp_path / "run"
    write_export(run_dir, digits, overrides=SMALL_RESNET)
    two_tasks = cluster_options(options(cluster="local", tasks_per_node=2, cpus_per_task=1))
    job = submit(two_tasks, run_dir, "final-eval", [
        Step("eval", ["knn", "--run", str(run_dir), "--ks", "20"], distributed=False),
        Step("transfer", ["finetune", "--run", str(run_dir), "--config", str(recipe)])])
    job.results()                                      # raises if a task failed; waits for both
    states = list((run_dir / "finetune").glob("*/checkpoints/step*/trainer_state.json"))
    assert states and all(json.loads(p.read_text())["world_size"] == 2 for p in states)
    assert (run_dir / "eval/knn_step0000042.json").is_file()


def test_a_jobs_progress_includes_the_fine_tuning_and_detection_runs_under_the_pretraining_run(tmp_path):
    """A fine-tuning job's requeue is refused when its allocation made no progress; its progress used to be read
    from RUN_DIR/checkpoints alone, which fine-tuning never writes, so it never requeued ("no optimizer step")."""
    from launch.jobs import StageJob, Step

    job = StageJob([Step("transfer", ["finetune"])], run_dir=str(tmp_path))
    assert job.progress() == {}

    def checkpoint(directory: str, step: int) -> None:
        (tmp_path / directory / f"step{step:08d}").mkdir(parents=True)
        (tmp_path / directory / f"step{step:08d}" / "trainer_state.json").write_text("{}")

    checkpoint("checkpoints", 500)
    before = job.progress()
    checkpoint("finetune/digits_10pct_export_step0000500/checkpoints", 40)
    checkpoint("finetune/digits_10pct_export_step0000500/checkpoints", 80)
    (tmp_path / "finetune/digits_10pct_export_step0000500/checkpoints/step00000120").mkdir()   # incomplete
    assert before == {".": 500}
    assert job.progress() == {".": 500, "finetune/digits_10pct_export_step0000500": 80} != before


def test_a_jobs_pickle_loads_without_torch_so_its_stop_signals_are_held_early():
    """Between the job's start and `StageJob.__call__` nothing handles SIGUSR2: a time-limit warning there killed
    the job, with no checkpoint and no requeue. Unpickling the job imported torch (launch/__init__ imported pretrain),
    3-7 s of that window idle on a 2-core AVX2 machine and more than the 55 s of CI's 1-minute watcher job under load
    (its fourth allocation died of "User defined signal 2" before printing a line). It now loads the standard library
    alone."""
    import pickle
    import subprocess
    import sys

    from launch.jobs import StageJob, Step

    job = pickle.dumps(StageJob([Step("eval", ["watch", "--run", "run"], distributed=False)], run_dir="run"))
    loads = ("import pickle, sys; job = pickle.loads(sys.stdin.buffer.read()); "
             "print(type(job).__name__, job.steps[0].stage, sorted(m for m in ('torch', 'numpy', 'pretrain') "
             "if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", loads], input=job, capture_output=True, cwd=ROOT, check=True)
    assert loaded.stdout.decode().split() == ["StageJob", "eval", "[]"], loaded.stderr.decode()[-2000:]


def test_a_finished_job_ignores_a_late_time_limit_warning(tmp_path):
    """A warning that lands after a job's last step must not fail the job. CI's fine-tuning job finished, submitit
    wrote its result ("Exiting after successful completion"), and the time-limit warning then killed the task while
    the interpreter shut down ("User defined signal 2"): CPython puts the default action back for every Python-level
    handler at that point, so the job, done, ended FAILED. Once its steps are done a job ignores the warning and
    SIGTERM; before that they stop the stage with a checkpoint (a Python handler)."""
    import subprocess
    import sys

    run_a_job_without_steps = (
        "import signal; from launch.jobs import StageJob; "
        "ignored = lambda: [signal.getsignal(s) is signal.SIG_IGN for s in (signal.SIGUSR2, signal.SIGTERM)]; "
        "before = ignored(); status = StageJob([])(); print(*before, status, *ignored())")
    job_environment = {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_FOLDER": str(tmp_path), "SUBMITIT_LOCAL_JOB_ID": "7",
                       "SUBMITIT_LOCAL_NTASKS": "1", "SUBMITIT_LOCAL_JOB_NUM_NODES": "1", "SUBMITIT_LOCAL_NODEID": "0",
                       "SUBMITIT_LOCAL_GLOBALID": "0", "SUBMITIT_LOCAL_LOCALID": "0"}
    ran = subprocess.run([sys.executable, "-c", run_a_job_without_steps], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, **job_environment})
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.split() == ["False", "False", "0", "True", "True"], ran.stdout + ran.stderr[-2000:]


def test_only_time_limits_count_against_max_requeues_and_a_preemption_is_always_requeued(tmp_path, capsys):
    """A stop signal is a time limit when the allocation has run min(80%, all but 10 minutes) of --time, as
    submitit's has_timed_out decides; earlier it is a preemption (preempt_send_user_signal). Preemptions used to be
    counted against --max-requeues (Slurm's SLURM_RESTART_COUNT counts them) and could exhaust it."""
    from types import SimpleNamespace

    from launch.jobs import LOCAL_REQUEUE_EXIT, StageJob, Step, time_limit_requeues

    job = StageJob([Step("pretrain", [])], max_requeues=1, run_dir=None, time_limit_min=60)
    assert not job.timed_out(time.time() - 10 * 60)             # 10 of 60 minutes: a preemption
    assert job.timed_out(time.time() - 50 * 60)                 # past min(48, 50) minutes: the time limit
    assert StageJob([], time_limit_min=1).timed_out(time.time())   # a 1-minute job: always its limit

    job_env = SimpleNamespace(cluster="local", job_id="123", paths=SimpleNamespace(folder=tmp_path))
    with pytest.raises(SystemExit) as requeued:
        job.requeue(job_env, {}, timed_out=True)                # the first time limit: requeued and counted
    assert requeued.value.code == LOCAL_REQUEUE_EXIT and time_limit_requeues(tmp_path, "123") == 1
    for _ in range(3):                                          # preemptions: always requeued, never counted
        with pytest.raises(SystemExit):
            job.requeue(job_env, {}, timed_out=False)
    assert time_limit_requeues(tmp_path, "123") == 1 and "preempted" in capsys.readouterr().err
    job.requeue(job_env, {}, timed_out=True)                    # the second time limit: max_requeues=1 reached
    assert "reached its time limit 2 times (max_requeues=1)" in capsys.readouterr().err
