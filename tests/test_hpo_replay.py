"""Searches replayed on a grid (launch/hpo_replay.py): the interpolation between grid points, deterministic
replays for a seed, every method's trajectories inside the box, and the Table 1 summary."""
import json

import numpy as np
import pytest

from launch.hpo_replay import Grid, replay, summary


def landscape_grid() -> Grid:
    """A 2-D grid in steps of 2 (as the paper's), its objective a smooth peak off the diagonal at
    (Lambda_p, Lambda_e) = (2^-4, 2^-1), with values in [0, 0.9]."""
    axis = 2.0 ** np.arange(-8, 3)
    log_p, log_e = np.meshgrid(np.log2(axis), np.log2(axis), indexing="ij")
    values = 0.9 * np.exp(-((log_p + 4) ** 2 + 4 * (log_e - log_p - 3) ** 2) / 20)
    return Grid(keys=["lambda_p", "lambda_e"], axes=[axis, axis], values=values, metric="synthetic")


def test_the_objective_is_the_grid_at_grid_points_and_linear_in_log_space_between_them(tmp_path):
    grid = landscape_grid()
    assert grid.objective(np.log([2.0 ** -4, 2.0 ** -1])) == pytest.approx(grid.values[4, 7])
    midpoint = np.log([2.0 ** -4 * np.sqrt(2), 2.0 ** -1])          # half-way between two grid points in log space
    assert grid.objective(midpoint) == pytest.approx((grid.values[4, 7] + grid.values[5, 7]) / 2)
    grid.save(tmp_path / "grid.json")
    again = Grid.load(tmp_path / "grid.json")
    assert again.keys == grid.keys and np.array_equal(again.values, grid.values)


def test_a_grid_with_missing_or_non_positive_points_is_refused():
    axis = 2.0 ** np.arange(3)
    with pytest.raises(ValueError, match="have no value"):
        Grid(["a"], [axis], [0.1, float("nan"), 0.3], "m")
    with pytest.raises(ValueError, match="positive, increasing"):
        Grid(["a"], [[0.0, 1.0, 2.0]], [0.1, 0.2, 0.3], "m")
    with pytest.raises(ValueError, match="needs values of that shape"):
        Grid(["a"], [axis], [0.1, 0.2], "m")


@pytest.mark.parametrize("method", ["cd", "random", "tpe", "cmaes"])
def test_replays_are_deterministic_for_a_seed_and_stay_on_the_grid(method):
    grid = landscape_grid()
    first = replay(grid, method, trajectories=3, budget=12, seed=5)
    assert first.shape == (3, 12)
    assert np.array_equal(first, replay(grid, method, trajectories=3, budget=12, seed=5))
    assert not np.array_equal(first, replay(grid, method, trajectories=3, budget=12, seed=6))
    assert np.all(first >= grid.values.min() - 1e-12) and np.all(first <= grid.values.max() + 1e-12)


def test_the_summary_gives_auc_and_n95_of_each_methods_mean_curve():
    curves = {"a": np.array([[0.2, 0.5, 0.4, 0.9], [0.4, 0.4, 0.8, 0.8]]),
              "b": np.array([[0.1, 0.1, 0.1, 0.3], [0.3, 0.2, 0.2, 0.2]])}
    rows = {row["method"]: row for row in summary(curves, auc_at=(2, 4))}
    # best-so-far: a: [0.2 0.5 0.5 0.9], [0.4 0.4 0.8 0.8] -> mean [0.3 0.45 0.65 0.85]
    assert rows["a"]["auc@2"] == pytest.approx((0.35 + 0.4) / 2)
    assert rows["a"]["auc@4"] == pytest.approx((2.1 + 2.4) / 4 / 2)
    assert rows["a"]["auc@4 sd"] == pytest.approx(np.std([2.1 / 4, 2.4 / 4], ddof=1))
    assert rows["a"]["final"] == pytest.approx(0.85) and rows["a"]["n-95"] == 4     # 0.95 x 0.85 = 0.8075
    assert rows["b"]["n-95"] is None


def test_the_command_prints_the_tables_and_writes_the_json_and_the_plot(tmp_path, capsys):
    from launch.__main__ import main

    landscape_grid().save(tmp_path / "grid.json")
    out = tmp_path / "replay"
    assert main(["hpo-replay", "--grid", str(tmp_path / "grid.json"), "--methods", "cd,random", "--trajectories",
                 "3", "--budget", "20", "--ablation", "--out-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "auc@10" in printed and "A_O (3, 3) rev" in printed
    result = json.loads((out / "replay.json").read_text())
    assert [row["method"] for row in result["summary"]] == ["cd", "random"] and len(result["ablation"]) == 5
    assert (out / "replay.png").stat().st_size > 0
    # bad input: one line, exit 2, nothing written
    assert main(["hpo-replay", "--grid", str(tmp_path / "none.json"), "--out-dir", str(tmp_path / "x")]) == 2
    assert main(["hpo-replay", "--grid", str(tmp_path / "grid.json"), "--methods", "cd,grid", "--out-dir",
                 str(tmp_path / "x")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and "none.json" in errors[0] and "'cd,grid'" in errors[1]
    with pytest.raises(SystemExit) as refused:            # a number out of range: refused by its argparse type
        main(["hpo-replay", "--grid", str(tmp_path / "grid.json"), "--budget", "10", "--out-dir", str(tmp_path / "x")])
    assert refused.value.code == 2 and "argument --budget: 10 is not" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("content", ["[]", "{}", '{"keys": ["a"], "axes": 5, "values": [1], "metric": "m"}'])
def test_a_grid_file_that_holds_no_grid_is_refused_in_one_line_naming_it(tmp_path, capsys, content):
    """A file holding `[]` was a TypeError traceback; `{}` said only "'keys'"."""
    from launch.__main__ import main

    grid = tmp_path / "grid.json"
    grid.write_text(content)
    assert main(["hpo-replay", "--grid", str(grid), "--out-dir", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"error: --grid {grid}: is not a grid" in err, err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("option, value, named", [("--trajectories", "0", "0 is not"), ("--seed", "-1", "-1 is not")])
def test_a_bad_number_is_refused_naming_its_option(tmp_path, capsys, option, value, named):
    """A negative seed was numpy's "expected non-negative integer" under "config error:"."""
    from launch.__main__ import main

    with pytest.raises(SystemExit) as refused:
        main(["hpo-replay", "--grid", str(tmp_path / "grid.json"), option, value, "--out-dir", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip()
    assert refused.value.code == 2 and f"argument {option}: {named}" in err and len(err.splitlines()) == 1, err
