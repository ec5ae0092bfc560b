"""Searches whose trials are jobs (launch/hpo.py): `launch grid` and `launch hpo` with the real Optuna study in
SQLite, resumed after a kill without running a finished trial again, and their bad input.

The trials here are computed, not trained: `ComputedTrials` replaces the job submission (one line, `submit_trial`)
by writing the evaluation JSON a trial's run would write, with a known landscape's value, so that a search of 20
trials takes a second. Everything else (the study, the resume, the grid file, the results) is the real code; the
jobs themselves run in `test_a_search_runs_its_trials_as_local_jobs`."""
import json
import math
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from launch.__main__ import build_parser, main
from launch.cluster import LaunchError
from launch.grid import grid_axis, run as run_grid
from launch.hpo import run as run_search
from launch.trials import Objective, SearchKey, TrialJobs, assignments, config_value
from pretrain.config import load_config

CONFIG = str(Path(__file__).parents[1] / "configs" / "pretrain" / "contrastive_balance_digits.yaml")


def landscape(lambda_p: float, lambda_e: float) -> float:
    """A peak on the balance direction, at Lambda_p = 2^-2, Lambda_e = 2^0 (values in (0, 0.9])."""
    log_p, log_e = math.log2(lambda_p), math.log2(lambda_e)
    return 0.9 * math.exp(-((log_p + 2) ** 2 + 4 * (log_e - log_p - 2) ** 2) / 20)


class ComputedTrials(TrialJobs):
    """A trial's job replaced by writing its result: the landscape's value at the trial's lambdas."""

    poll_seconds = 0.1
    submitted: list[str] = []
    fail: set[str] = set()
    stop_after: int | None = None          # raise KeyboardInterrupt (a killed search) at this submission

    def submit_trial(self, name, trial_overrides):
        if self.stop_after is not None and len(ComputedTrials.submitted) >= self.stop_after:
            raise KeyboardInterrupt
        ComputedTrials.submitted.append(name)
        values = dict(override.split("=") for override in trial_overrides)
        failed = name in self.fail
        for folder in ("checkpoints/step00000010", "exports/step00000010"):      # what a trained trial leaves
            (self.run_dir(name) / folder).mkdir(parents=True, exist_ok=True)
        (self.run_dir(name) / "metrics.jsonl").write_text("".join(    # its training clock: 1.5 minutes at the end
            json.dumps(line) + "\n" for line in ({"step": 5, "perf/training_seconds": 40.0}, {"step": 10, "loss": 1.0},
                                                 {"step": 10, "perf/training_seconds": 90.0})))
        if not failed:
            result = self.run_dir(name) / "eval" / "retrieval_step0000010.json"
            result.parent.mkdir(parents=True, exist_ok=True)
            result.write_text(json.dumps({"r_map": landscape(float(values["method.lambda_p"]),
                                                             float(values["method.lambda_e"]))}))
        return SimpleNamespace(job_id=name, done=lambda: True, paths=SimpleNamespace(stderr="ERR"),
                               exception=lambda: RuntimeError("failed") if failed else None)


@pytest.fixture(autouse=True)
def fresh_trials():
    ComputedTrials.submitted, ComputedTrials.fail, ComputedTrials.stop_after = [], set(), None


def parse(command: str, *argv: str):
    return build_parser().parse_args([command, "--config", CONFIG, "--objective", "retrieval:r_map",
                                      "--cluster", "local", *argv])


def search(out: Path, method: str, trials: int = 20, *extra: str) -> list[dict]:
    run_search(parse("hpo", "--space", "method.lambda_p=0.0625:4:log", "--space", "method.lambda_e=0.0625:4:log",
                     "--method", method, "--trials", str(trials), "--out-dir", str(out), *extra), ComputedTrials)
    return json.loads((out / "trials.json").read_text())


def test_a_grid_measures_every_point_once_and_a_failed_point_is_retried_alone(tmp_path, capsys):
    argv = ["--axis", "method.lambda_p=0.25:1", "--axis", "method.lambda_e=0.5,2", "--out-dir", str(tmp_path)]
    ComputedTrials.fail = {"point_lambda-p0.5_lambda-e2"}
    assert run_grid(parse("grid", *argv), ComputedTrials) == 1
    assert "1 of 6 points failed" in capsys.readouterr().out and not (tmp_path / "grid.json").exists()
    # the failed trial keeps its checkpoints: its job, submitted again, resumes from them
    assert (tmp_path / "trials" / "point_lambda-p0.5_lambda-e2" / "checkpoints").is_dir()
    ComputedTrials.submitted, ComputedTrials.fail = [], set()
    assert run_grid(parse("grid", *argv), ComputedTrials) == 0
    assert ComputedTrials.submitted == ["point_lambda-p0.5_lambda-e2"]          # the others were read back
    assert "cost: 6 trials, 9.0 minutes of training in all" in capsys.readouterr().out   # the points read back too
    grid = json.loads((tmp_path / "grid.json").read_text())
    assert grid["keys"] == ["method.lambda_p", "method.lambda_e"]
    assert grid["axes"] == [[0.25, 0.5, 1.0], [0.5, 2.0]]
    expected = [[landscape(p, e) for e in (0.5, 2.0)] for p in (0.25, 0.5, 1.0)]
    assert np.allclose(grid["values"], expected) and grid["metric"] == "retrieval r_map"
    # a measured trial keeps its result and loses its checkpoints and exports (hundreds of MB each)
    trial = tmp_path / "trials" / "point_lambda-p0.25_lambda-e0.5"
    assert (trial / "eval").is_dir() and not (trial / "checkpoints").exists() and not (trial / "exports").exists()
    kept = tmp_path / "kept"
    assert run_grid(parse("grid", "--axis", "method.lambda_p=1", "--axis", "method.lambda_e=1", "--out-dir", str(kept),
                          "--keep-checkpoints"), ComputedTrials) == 0
    assert (kept / "trials" / "point_lambda-p1_lambda-e1" / "checkpoints").is_dir()


@pytest.mark.parametrize("method", ["cd", "tpe"])
def test_a_killed_search_resumes_without_running_a_finished_trial_again(tmp_path, method):
    whole = search(tmp_path / "whole", method, 14)      # TPE: its 10 random start-up trials, then its own
    assert len(whole) == 14 and len(ComputedTrials.submitted) == 14
    ComputedTrials.submitted, ComputedTrials.stop_after = [], 7
    with pytest.raises(KeyboardInterrupt):
        search(tmp_path / "killed", method, 14)
    first = list(ComputedTrials.submitted)
    ComputedTrials.stop_after = None
    resumed = search(tmp_path / "killed", method, 14)
    again = ComputedTrials.submitted[len(first):]
    assert len(resumed) == 14 and not set(first) & set(again)         # no finished trial ran twice
    points = {(row["method.lambda_p"], row["method.lambda_e"]) for row in resumed}
    if method == "cd":             # deterministic given the values: the resumed search walks the same path
        assert resumed == whole
    else:                          # the resumed sampler is seeded past the finished trials: no point drawn twice
        assert len(points) == 14
    best = max(row["value"] for row in resumed)
    assert resumed[-1]["best so far"] == best


def test_coordinate_descent_starts_at_the_configs_values_and_climbs_the_landscape(tmp_path, capsys):
    rows = search(tmp_path, "cd", 20)
    assert [row["minutes"] for row in rows] == [1.5] * 20                # each trial's training clock, its last
    assert "cost: 20 trials, 30.0 minutes of training in all" in capsys.readouterr().out
    assert (rows[0]["method.lambda_p"], rows[0]["method.lambda_e"]) == ("1", "1")     # the config's 1.0, 1.0
    assert rows[0]["value"] == pytest.approx(landscape(1, 1))
    assert rows[-1]["best so far"] > landscape(1, 1) + 0.2
    assert rows[-1]["best so far"] > 0.85                               # the peak is 0.9
    assert (tmp_path / "best_so_far.png").stat().st_size > 0 and (tmp_path / "study.db").is_file()


def test_a_failed_trial_is_a_failed_trial_of_the_study_and_the_search_goes_on(tmp_path, capsys):
    ComputedTrials.fail = {"trial0002"}
    rows = search(tmp_path, "random", 5)
    assert [row["value"] is None for row in rows] == [False, False, True, False, False]
    assert "trial trial0002 failed: see ERR" in capsys.readouterr().out
    import optuna

    study = optuna.load_study(study_name="search", storage=f"sqlite:///{tmp_path / 'study.db'}")
    assert study.trials[2].state == optuna.trial.TrialState.FAIL and len(study.trials) == 5


def test_a_search_whose_every_trial_failed_exits_non_zero_naming_the_logs_and_writes_no_results(tmp_path, capsys):
    """It exited 0 and wrote trials.json and best_so_far.png, a results table of nothing but failures."""
    ComputedTrials.fail = {f"trial{number:04d}" for number in range(3)}
    args = parse("hpo", "--space", "method.lambda_p=0.0625:4:log", "--space", "method.lambda_e=0.0625:4:log",
                 "--method", "random", "--trials", "3", "--out-dir", str(tmp_path))
    assert run_search(args, ComputedTrials) == 1
    err = capsys.readouterr().err
    assert f"error: every trial of the search failed (3 of 3): their logs are {tmp_path}/trials/*/jobs/" in err
    assert not (tmp_path / "trials.json").exists() and not (tmp_path / "best_so_far.png").exists()


def test_a_search_directory_with_other_settings_is_refused_naming_them(tmp_path):
    search(tmp_path, "random", 3)
    with pytest.raises(LaunchError, match=r"other settings \(method: 'random' there\)"):
        search(tmp_path, "tpe", 3)


@pytest.mark.parametrize("text, message", [
    ("method.lambda_p=1", "is not KEY=LOW:HIGH"), ("method.lambda_p=2:1", "LOW must be below HIGH"),
    ("method.lambda_p=0:1:log", "positive on a log scale"), ("method.lambda_p=a:1", "is not KEY=LOW:HIGH")])
def test_a_bad_search_space_is_refused_naming_it(text, message):
    with pytest.raises(LaunchError, match=message):
        SearchKey.parse(text)


def test_search_keys_axes_and_objectives_parse_as_documented(tmp_path):
    key = SearchKey.parse("method.lambda_p=0.0625:4:log")
    assert key.log and key.from_search(key.to_search(4.0)) == 4.0 and key.from_search(10.0) == 4.0
    assert not SearchKey.parse("optim.lr=0.1:0.5").log
    assert grid_axis("method.lambda_p=0.0625:4", 2.0) == ("method.lambda_p", [2.0 ** i for i in range(-4, 3)])
    assert grid_axis("optim.lr=0.1,0.3", 2.0) == ("optim.lr", [0.1, 0.3])
    with pytest.raises(LaunchError, match="positive, increasing"):
        grid_axis("optim.lr=0.3,0.1", 2.0)
    with pytest.raises(LaunchError, match="is not PROTOCOL:FIELD"):
        Objective.parse("knn")
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "knn_step0000005.json").write_text(json.dumps({"top1": {"20": 0.5}}))
    (tmp_path / "eval" / "knn_step0000010.json").write_text(json.dumps({"top1": {"20": 0.75}}))
    assert Objective.parse("knn:top1.20").read(tmp_path) == 0.75                      # the newest export's
    assert Objective.parse("linear:top1").read(tmp_path) is None                       # not evaluated yet
    with pytest.raises(LaunchError, match="has no 'top5'; its fields here: top1"):
        Objective.parse("knn:top5").read(tmp_path)


def test_a_search_moves_one_crop_bound_starting_from_the_configs_value():
    config = str(Path(CONFIG).with_name("simclr_fashion_mnist.yaml"))           # its views' scale: [0.3, 1.0]
    assert config_value(config, [], "data.views.0.scale.0", "--space") == 0.3
    trial = assignments({"data.views.0.scale.0": 0.18}, set())
    assert trial == ["data.views.0.scale.0=0.18"]
    assert list(load_config(config, trial).data.views[0].scale) == [0.18, 1.0]


def test_the_commands_refuse_a_bad_key_or_direction_setting_in_one_line(tmp_path, capsys):
    base = ["hpo", "--config", CONFIG, "--cluster", "local", "--out-dir", str(tmp_path / "s"), "--objective",
            "retrieval:r_map"]
    assert main([*base, "--space", "method.lambda_x=1:2:log"]) == 2
    assert "error: method.lambda_x: the config has no such key" in capsys.readouterr().err
    assert main([*base, "--space", "method.lambda_p=1:2", "--space", "method.lambda_e=1:2", "--space",
                 "optim.lr=0.1:1", "--space", "optim.weight_decay=0.1:1"]) == 2
    assert "--directions paper needs 2 or 3 keys" in capsys.readouterr().err
    assert main([*base, "--space", "method.lambda_p=1:2", "--eval-args=--split-clases"]) == 2
    assert "--eval-args '--split-clases': `python -m eval retrieval` does not take them" in capsys.readouterr().err
    assert not (tmp_path / "s" / "trials").exists()                          # nothing ran


SPACE = ["--space", "method.lambda_p=0.0625:4:log", "--space", "method.lambda_e=0.0625:4:log"]


@pytest.mark.parametrize("argv, named", [
    (["hpo", *SPACE, "--budgets", "3,x"], "argument --budgets: '3,x': 'x' is not"),
    (["hpo", *SPACE, "--start", "a,b"], "argument --start: 'a,b': 'a' is not"),
    (["hpo", *SPACE, "--trials", "0"], "argument --trials: 0 is not"),
    (["hpo", *SPACE, "--seed", "-1"], "argument --seed: -1 is not"),
    (["grid", "--axis", "method.lambda_p=1,2", "--parallel", "0"], "argument --parallel: 0 is not"),
    (["grid", "--axis", "method.lambda_p=1:4", "--factor", "1"], "argument --factor: 1 is not"),
    (["grid", "--axis", "method.lambda_p=1:4", "--factor", "0.5"], "argument --factor: 0.5 is not"),
    (["hpo", *SPACE, "--out-dir", __file__], f"argument --out-dir: {__file__} is a file"),
])
def test_a_bad_number_is_refused_by_its_option_when_the_command_line_is_read(capsys, argv, named):
    """`--budgets 3,x` and `--start a,b` printed "invalid literal ..." after search.json and study.db were written,
    so the corrected command was refused as "a search with other settings"; `--parallel 0` ran no trial and
    reported every point failed; `--factor 0.5` was blamed on --axis. Now argparse refuses them, before anything
    runs (parse_args only: a regression must not start a search)."""
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args([*argv, "--config", CONFIG, "--cluster", "local", "--out-dir", "s"])
    err = capsys.readouterr().err.strip()
    assert refused.value.code == 2 and named in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("argv, named", [
    (["--budgets", "3"], "--budgets 3 needs one value per --space key (2)"),
    (["--start", "1,1,1"], "--start 1,1,1 needs one value per --space key (2)"),
    (["--space", "optim.lr=0.1:1", "--space", "optim.weight_decay=0.1:1"], "--directions paper needs 2 or 3 keys"),
    (["--space", "method.name=1:2", "--directions", "identity"],
     "--space method.name: the config's method.name is 'contrastive_balance', not a number"),
    (["--space", "data.eval_crop_fraction=0.5:1.5", "--directions", "identity"],
     "data.eval_crop_fraction=1.5, which the config refuses: data.eval_crop_fraction=1.5 must lie in (0, 1]"),
])
def test_a_refused_search_writes_nothing_and_the_corrected_command_then_runs(tmp_path, argv, named):
    """Each was refused after search.json and study.db were written (and `method.name` as "could not convert
    string to float"): the corrected command was then refused as "a search with other settings"."""
    out = tmp_path / "s"
    with pytest.raises(LaunchError, match=re.escape(named)):
        run_search(parse("hpo", *SPACE, "--trials", "2", "--out-dir", str(out), *argv), ComputedTrials)
    assert not out.exists() and ComputedTrials.submitted == []
    assert len(search(out, "cd", 2)) == 2                              # the corrected command: not refused


def test_a_grid_checks_every_points_config_before_submitting_any(tmp_path):
    """`--axis optim.name=1,2` (a key that is not a number) and a value the config refuses submitted one job per
    point, each of which failed; `--axis K=0:4` and `K=1:inf` were a ZeroDivisionError and an OverflowError."""
    def grid(*axes: str) -> int:
        return run_grid(parse("grid", *(part for axis in axes for part in ("--axis", axis)), "--out-dir",
                              str(tmp_path / "g")), ComputedTrials)

    with pytest.raises(LaunchError, match="--axis optim.name: the config's optim.name is 'sgd', not a number"):
        grid("optim.name=1,2")
    with pytest.raises(LaunchError, match=r"--axis gives a trial .*data.eval_crop_fraction=1.5, which the config "
                                          r"refuses: data.eval_crop_fraction=1.5 must lie in \(0, 1\]"):
        grid("method.lambda_p=1", "method.lambda_e=1", "data.eval_crop_fraction=0.5,1.5")
    with pytest.raises(LaunchError, match="--axis 'method.lambda_p=0:4': 0 is not"):
        grid("method.lambda_p=0:4")
    with pytest.raises(LaunchError, match="--axis 'method.lambda_p=1:inf': 'inf' is not finite"):
        grid("method.lambda_p=1:inf")
    assert ComputedTrials.submitted == [] and not (tmp_path / "g").exists()


def test_a_restarted_grid_waits_for_a_trial_job_still_running_from_before_instead_of_submitting_it(tmp_path):
    """A stopped search leaves its jobs running (Slurm's outlive it, and so do local ones): started again, it
    waits for them. Here a local "job" (a process recorded in the trial's jobs.jsonl) writes its result after a
    second."""
    import subprocess
    import threading

    run_dir = tmp_path / "trials" / "point_lambda-p0.25_lambda-e2"
    result = run_dir / "eval" / "retrieval_step0000010.json"
    result.parent.mkdir(parents=True)
    writer = subprocess.Popen([sys.executable, "-c", "import json, sys, time; time.sleep(1.5); "
                               f"open({str(result)!r}, 'w').write(json.dumps({{'r_map': 0.125}}))"])
    threading.Thread(target=writer.wait, daemon=True).start()        # reaped when it ends, as a job's process
    (run_dir / "jobs.jsonl").write_text(json.dumps({"kind": "trial", "job_id": str(writer.pid), "cluster": "local",
                                                    "folder": str(run_dir / "jobs"), "stderr": "ERR"}) + "\n")
    args = parse("grid", "--axis", "method.lambda_p=0.25:0.5", "--axis", "method.lambda_e=2", "--out-dir",
                 str(tmp_path))
    args.parallel = 2
    assert run_grid(args, ComputedTrials) == 0
    assert ComputedTrials.submitted == ["point_lambda-p0.5_lambda-e2"]          # not the running one
    assert json.loads((tmp_path / "grid.json").read_text())["values"] == [[0.125], [landscape(0.5, 2)]]
