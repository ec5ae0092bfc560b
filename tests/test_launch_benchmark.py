"""`python -m launch benchmark FILE` (launch/benchmark.py): a tiny benchmark file run end to end as real local jobs on
the embedded digits (a row killed with its benchmark and resumed; the table read back from the runs' results), the
seeds' curves averaged mark by mark, and a file's bad values refused by name before anything runs."""
import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from launch.benchmark_file import Row, check_same_benchmark, load_benchmark, select_rows, select_seeds
from launch.benchmark_results import FINAL, Run, mark_keys, row_curve, summarise
from launch.benchmark_table import markdown
from launch.cluster import LaunchError
from tests.machine_speed import scaled
from tests import forked_runs
from tests.conftest import wait_for
from tests.engine_helpers import SMALL_RESNET
from tests.git_checkouts import this_checkouts_label
from tests.run_helpers import ROOT, kill_process_tree

CONFIG = str(ROOT / "configs/pretrain/simclr_digits.yaml")
RECIPE = str(ROOT / "configs/transfer/finetune_digits.yaml")
# 8 px views and evaluation, the small ResNet: the same jobs as the shipped files', each export scored in under a second
SMALL = ["data.batch_size=32", "data.num_workers=1", "data.views.0.size=8", "model.proj_hidden_dim=64",
         "model.proj_out_dim=32", "engine.image_grid_every_steps=0", *SMALL_RESNET]
STANDARDISED_8PX = "standardised pixels (scikit-learn: tuned k-NN, logistic regression), 8 px"


def write_benchmark(path: Path, rows: list[dict], references: dict | None = None, **more) -> Path:
    path.write_text(yaml.safe_dump({"name": "tiny", **({"references": references} if references else {}),
                                    "rows": rows, **more}))
    return path


@pytest.mark.slow
def test_a_benchmark_runs_its_rows_as_jobs_resumes_a_killed_one_and_tables_their_results(few_digits, tmp_path):
    data = [f"data.train={few_digits / 'train.beton'}", f"data.val={few_digits / 'val.beton'}"]
    references = {"config": CONFIG, "image_sizes": [8], "overrides": [*data, "data.num_workers=1", *SMALL_RESNET]}
    file = write_benchmark(tmp_path / "tiny.yaml", references=references, rows=[
        {"name": "simclr", "label": "SimCLR", "config": CONFIG, "overrides": [*data, *SMALL], "steps": 6, "marks": 6},
        {"name": "cross_entropy", "config": CONFIG, "overrides": [*data, *SMALL], "supervised": RECIPE,
         "supervised_overrides": ["data.label_fraction=100%", "data.batch_size=128"], "steps": 6, "marks": 6}],
        comparisons=[["simclr", "cross_entropy"]])
    out = tmp_path / "bench"
    command = ["benchmark", str(file), "--cluster", "local", "--out-dir", str(out)]
    first = forked_runs.start("launch", command)
    simclr = out / "rows" / "simclr_seed0"
    wait_for(lambda: (simclr / "checkpoints" / "latest").exists(), first, "the SimCLR row's first checkpoint")
    kill_process_tree(first.pid)                  # the benchmark and the job it runs, as a lost session
    first.wait(timeout=scaled(60))
    job = json.loads((simclr / "jobs.jsonl").read_text())["job_id"]     # a local job's id is its process's
    for _ in range(600):                          # gone, not dying: a job alive when the benchmark restarts is awaited
        if not Path(f"/proc/{job}").exists():
            break
        time.sleep(0.05)
    killed_at = int((simclr / "checkpoints" / "latest").read_text().removeprefix("step"))
    assert killed_at < 6 and not (simclr / "finished.json").exists()

    # --finished-only: the table of what has finished (the reference), the rest named, nothing submitted.
    partial = forked_runs.run("launch", [*command, "--finished-only"], timeout=120)
    table = json.loads((out / "table.json").read_text())
    assert [entry["label"] for entry in table["rows"]] == ["raw pixels, 8 px", "random init, 8 px", STANDARDISED_8PX]
    assert table["not_finished"] == ["simclr_seed0", "cross_entropy_seed0"]
    assert "A partial table: 2 runs of the file have not finished" in partial.stdout
    assert len((simclr / "jobs.jsonl").read_text().splitlines()) == 1
    assert not (out / "rows" / "cross_entropy_seed0").exists()

    second = forked_runs.run("launch", command, timeout=240)
    jobs = {row: [json.loads(line) for line in (out / "rows" / row / "jobs.jsonl").read_text().splitlines()]
            for row in ("references_8px_seed0", "simclr_seed0", "cross_entropy_seed0")}
    assert [len(submitted) for submitted in jobs.values()] == [1, 2, 1]    # the finished reference was read back
    assert f"resumed {simclr} at step {killed_at} " in Path(jobs["simclr_seed0"][1]["stdout"]).read_text()
    assert not (simclr / "checkpoints").exists()                         # a scored run keeps its results, not these

    # The table holds what the runs' evaluations wrote.
    rows = {entry["label"]: entry for entry in json.loads((out / "table.json").read_text())["rows"]}
    result = {protocol: json.loads((simclr / "eval" / f"{protocol}_step0000006.json").read_text())["top1"]
              for protocol in ("knn", "linear")}
    assert rows["SimCLR"]["knn"]["values"] == [round(100 * result["knn"]["20"], 2)]
    assert rows["SimCLR"]["linear"]["values"] == [round(100 * result["linear"], 2)]
    assert [point["step"] for point in rows["SimCLR"]["runs"][0]["points"]] == [1, 2, 3, 4, 5, 6]   # the 6 marks
    assert len(rows["SimCLR"]["curve"]["knn"]) == 6 and rows["SimCLR"]["cores"] == os.cpu_count()
    classifier = json.loads((out / "rows/cross_entropy_seed0/eval/finetune_100pct_random_step0000001.json"
                             ).read_text())["top1"]
    assert rows["cross_entropy (classifier top-1)"]["linear"]["values"] == [round(100 * classifier, 2)]
    baselines = json.loads((out / "rows/references_8px_seed0/eval/baselines_step0000000.json").read_text())
    assert rows["raw pixels, 8 px"]["knn"]["values"] == [round(100 * baselines["raw_pixels"]["knn"], 2)]
    assert rows["random init, 8 px"]["linear"]["values"] == [round(100 * baselines["random_init"]["linear"], 2)]
    assert rows[STANDARDISED_8PX]["linear"]["values"] == [
        round(100 * baselines["standardised_pixels"]["linear"], 2)]
    table = (out / "table.md").read_text()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert table.startswith(f"Made by `python -m launch {' '.join(command)}` at commit {commit}")
    assert (f"| SimCLR | 6 steps, 6 marks | 0 | {100 * result['knn']['20']:.2f}% (1 seed: no interval) | "
            f"{100 * result['linear']:.2f}% (1 seed: no interval) |") in table
    # Every row's runs (the killed and resumed one, the fine-tuning, the references) recorded this checkout's code:
    # each row shows it, and nothing is mixed.
    here = this_checkouts_label(ROOT)
    finals = [line for line in table.split("\n\n")[2].splitlines() if line.startswith("| ")][2:]
    assert len(finals) == 5 and all(line.endswith(f"| {here} |") for line in finals), finals
    written = json.loads((out / "table.json").read_text())
    assert (written["mixed_code"], written["code_warnings"]) == (False, [])
    assert [start["step"] for start in json.loads((simclr / "provenance.json").read_text())] == [0, killed_at]
    # one seed each: the comparison says why it has no paired difference (and a supervised row has no k-NN)
    assert ("| SimCLR | cross_entropy (classifier top-1) | linear | - | a paired comparison needs at least 2 seeds "
            "both rows ran; they share 1 (0; the row has seeds [0], the baseline [0]): run the same seeds of both | - "
            "| - |") in table
    assert [m["measure"] for m in written["comparisons"][0]["measures"]] == ["linear"]
    assert table.strip() in second.stdout and (out / "curves.png").stat().st_size > 0


def points(*minutes: float, epochs: list[int] | None = None) -> list[dict]:
    return [{"step": 10 * (i + 1), "minutes": m, "knn": 0.5 + m / 10, "linear": 0.6 + m / 10,
             **({"epoch": epochs[i]} if epochs else {})} for i, m in enumerate(minutes)]


def test_the_seeds_curves_are_averaged_mark_by_mark():
    """A minutes budget's mark i is the first export at or past i x minutes / marks (where the loop checkpointed); an
    export a signal added between marks is in its run's points, not in the row's curve; the last point is the
    budget's, wherever it fell. A steps budget's marks are steps, a supervised run's epochs."""
    row = Row(name="r", label="r", kind="pretrain", config="c", minutes=1.0, marks=4)
    first, second = points(0.252, 0.4, 0.5, 0.76, 1.002), points(0.26, 0.51, 0.75, 1.0)
    for run in (first, second):
        mark_keys(row, run)
    assert [p["key"] for p in first] == [1, None, 2, 3, FINAL] and [p["key"] for p in second] == [1, 2, 3, FINAL]
    curve = row_curve([Run(0, "a", first), Run(1, "b", second)], "knn")
    assert [p["minutes"] for p in curve] == [0.256, 0.505, 0.755, 1.001]
    assert curve[0]["values"] == [52.52, 52.6] and curve[0]["mean"] == 52.56 and curve[0]["std"] == 0.06
    stepped = points(0.1, 0.2, 0.3)
    mark_keys(Row(name="s", label="s", kind="pretrain", config="c", steps=30, marks=3), stepped)
    assert [p["key"] for p in stepped] == [10, 20, FINAL]
    supervised = points(0.3, 0.6, 0.7, epochs=[0, 1, 2])
    mark_keys(Row(name="x", label="x", kind="supervised", config="c", minutes=1.0), supervised)
    assert [p["key"] for p in supervised] == [0, 1, FINAL] and "epoch" not in supervised[0]


def test_a_reference_gives_the_standardised_pixels_row_when_its_result_has_it():
    """`eval baselines` writes a third encoder, standardised pixels by tuned scikit-learn classifiers: the table shows
    it beside raw pixels and random init; a result written before it existed still gives the other two."""
    row = Row(name="references_28px", label="28 px", kind="reference", config="c", seeds=(0,))
    old = {"raw_pixels": {"knn": 0.8569, "linear": 0.8242}, "random_init": {"knn": 0.8225, "linear": 0.8347}}
    new = {**old, "standardised_pixels": {"knn": 0.8535, "linear": 0.8471, "logistic_regression": {"C": 0.01}}}
    assert [entry["label"] for entry in summarise(row, [old])] == ["raw pixels, 28 px", "random init, 28 px"]
    entries = summarise(row, [new])
    assert [entry["kind"] for entry in entries] == ["raw_pixels", "random_init", "standardised_pixels"]
    assert entries[2]["label"] == "standardised pixels (scikit-learn: tuned k-NN, logistic regression), 28 px"
    assert (entries[2]["knn"]["values"], entries[2]["linear"]["values"]) == ([85.35], [84.71])
    assert "| standardised pixels (scikit-learn: tuned k-NN, logistic regression), 28 px | - | 0 | 85.35%" in markdown(
        entries, "made by test")


def test_the_table_shows_each_rows_curve_mark_by_mark_for_comparing_rows_at_equal_minutes():
    """Below the finals, a column per mark: its minutes (mean over the seeds), then k-NN / linear, mean ± std over
    the seeds; a supervised row has no k-NN; a row with fewer marks leaves the last cells empty."""
    machine = {"cores": 2, "threads": 2, "load_median": 1.8, "load_max": 2.1}
    pretrain = Row(name="p", label="SimCLR", kind="pretrain", config="c", seeds=(0, 1), minutes=1.0, marks=2)
    runs = [Run(0, "a", points(0.5, 1.0), machine), Run(1, "b", points(0.52, 1.02), machine)]
    supervised = Row(name="s", label="cross-entropy", kind="supervised", config="c", minutes=1.0)
    single = [Run(0, "c", [{**p, "knn": None} for p in points(0.3, 0.6, 0.9, epochs=[0, 1, 2])], machine)]
    for row, row_runs in ((pretrain, runs), (supervised, single)):
        for run in row_runs:
            mark_keys(row, run.points)
    table = markdown(summarise(pretrain, runs) + summarise(supervised, single), "made by test").splitlines()
    assert table[table.index("| row | mark 1 | mark 2 | mark 3 |") + 1] == "| --- | --- | --- | --- |"
    assert "| SimCLR | 0.5 min: 55.10% ± 0.14 / 65.10% ± 0.14 | 1.0 min: 60.10% ± 0.14 / 70.10% ± 0.14 |  |" in table
    assert "| cross-entropy (classifier top-1) | 0.3 min: - / 63.00% | 0.6 min: - / 66.00% | 0.9 min: - / 69.00% |" \
        in table


def test_the_finals_show_their_t_interval_and_a_comparison_its_paired_difference_over_the_common_seeds():
    """The file's comparison [hvs, plain]: row minus baseline at the budget's end per measure, over the seeds both
    finished (seed 3 of one row alone is left out), equal to scipy's paired t-test; each final with its 95% t
    interval (eval/statistics.py, tested against scipy there)."""
    from scipy import stats

    from launch.benchmark_results import paired_differences

    machine = {"cores": 2, "threads": 2, "load_median": 1.8, "load_max": 2.1}
    finals = {"plain": {0: (0.800, 0.850), 1: (0.812, 0.861), 2: (0.795, 0.846)},
              "hvs": {0: (0.808, 0.852), 1: (0.822, 0.866), 2: (0.801, 0.851), 3: (0.9, 0.9)}}
    entries = []
    for name, seeds in finals.items():
        row = Row(name=name, label=name.upper(), kind="pretrain", config="c", seeds=tuple(seeds), steps=6, marks=6)
        runs = [Run(seed, f"runs/{name}_{seed}", [{"step": 6, "minutes": 1.0, "knn": knn, "linear": linear}], machine)
                for seed, (knn, linear) in seeds.items()]
        for run in runs:
            mark_keys(row, run.points)
        entries += summarise(row, runs)
    assert entries[0]["knn"]["ci95"] == [round(bound, 2) for bound in stats.t.interval(
        0.95, 2, loc=np.mean([80.0, 81.2, 79.5]), scale=stats.sem([80.0, 81.2, 79.5]))]
    paired = paired_differences(entries, [("hvs", "plain")])
    knn = stats.ttest_rel([80.8, 82.2, 80.1], [80.0, 81.2, 79.5])
    assert paired[0]["measures"][0]["seeds"] == [0, 1, 2]
    assert paired[0]["measures"][0]["p_value"] == pytest.approx(knn.pvalue, rel=1e-3)
    assert paired[0]["measures"][0]["ci95"] == pytest.approx(list(knn.confidence_interval(0.95)), abs=0.005)
    table = markdown(entries, "made by test", paired).splitlines()
    low, high = knn.confidence_interval(0.95)
    assert f"| HVS | PLAIN | k-NN | 0, 1, 2 | +0.80 | [{low:+.2f}, {high:+.2f}] | {knn.pvalue:.3g} |" in table
    assert table[6].startswith("| PLAIN | 6 steps, 6 marks | 0, 1, 2 | 80.23% ± 0.87, 95% CI [78.06, 82.40] | ")
    assert table[6].endswith("| unknown |")                                 # runs without provenance.json
    missing = paired_differences(entries, [("hvs", "gone")])
    assert missing[0]["error"] == "no finished run of gone in this table"
    same = paired_differences(entries, [("plain", "plain")])                  # differences all 0: said, not tested
    assert "| PLAIN | PLAIN | k-NN | 0, 1, 2 | +0.00 (the 3 differences are all 0: no spread, so no t-test and no " \
        "interval) | - | - |" in markdown(entries, "made by test", same).splitlines()



def test_the_paired_difference_at_each_mark_the_chosen_views_and_the_curve_against_counted_compute(tmp_path):
    """A selection study's table: at each mark (the i-th keyed point of each row: the same share of a compute budget,
    though the rows took different steps) the paired difference of the arm against none, equal to scipy's paired
    t-test; the chosen views' scalars as means over the seeds of each run's means; the curves' counted PFLOP (a
    point's step times the counted FLOPs of a step) drawn against counted compute."""
    from scipy import stats

    from launch.benchmark_results import paired_differences, selection_means
    from launch.benchmark_table import plot

    machine = {"cores": 2, "threads": 2, "load_median": 1.8, "load_max": 2.1}
    accuracy = {"none": [[0.70, 0.80], [0.71, 0.82], [0.69, 0.79]],            # seed -> (mark 1, end)
                "hardest": [[0.72, 0.81], [0.70, 0.84], [0.73, 0.80]]}
    steps = {"none": 60, "hardest": 36}                                          # one budget, different steps
    entries = []
    for name, by_seed in accuracy.items():
        row = Row(name=name, label=name, kind="pretrain", config="c", seeds=(0, 1, 2), pflop=0.01, marks=2)
        runs = []
        for seed, values in enumerate(by_seed):
            points = [{"step": steps[name] * (i + 1) // 2, "minutes": i + 1.0, "knn": v, "linear": v,
                       "pflop": 0.005 * (i + 1)} for i, v in enumerate(values)]
            mark_keys(row, points)
            lines = [{"step": 1, "hvs/selected_iou": 0.2 + seed / 10, "hvs/mean_pair_iou": 0.5},
                     {"step": 2, "hvs/selected_iou": 0.4 + seed / 10, "hvs/mean_pair_iou": 0.5}, {"step": 3}]
            runs.append(Run(seed, f"runs/{name}_{seed}", points, machine, selection=selection_means(lines)
                            if name == "hardest" else {}))
        entries += summarise(row, runs)
    assert entries[1]["selection"]["selected_iou"] == {"mean": 0.4, "std": 0.1}         # runs: 0.3, 0.4, 0.5
    assert entries[0]["selection"] == {} and [p["pflop"] for p in entries[1]["curve"]["knn"]] == [0.005, 0.01]
    paired = paired_differences(entries, [("hardest", "none")])
    marks = paired[0]["measures"][0]["marks"]
    assert [mark["mark"] for mark in marks] == [1, 2]
    for mark, index in zip(marks, (0, 1)):
        test = stats.ttest_rel([100 * v[index] for v in accuracy["hardest"]], [100 * v[index] for v in accuracy["none"]])
        assert mark["p_value"] == pytest.approx(test.pvalue, rel=1e-3)
        assert mark["ci95"] == pytest.approx(list(test.confidence_interval(0.95)), abs=0.005)
    assert marks[1]["difference"] == paired[0]["measures"][0]["difference"]             # the last mark is the end
    table = markdown(entries, "made by test", paired).splitlines()
    low, high = marks[0]["ci95"]
    assert f"| hardest | none | k-NN | {marks[0]['difference']:+.2f} [{low:+.2f}, {high:+.2f}] | " \
           f"{marks[1]['difference']:+.2f} [{marks[1]['ci95'][0]:+.2f}, {marks[1]['ci95'][1]:+.2f}] |" in table
    assert "| hardest | - | - | 0.400 ± 0.100 | 0.500 ± 0.000 | - | - | - |" in table
    plot(entries, tmp_path / "curves_pflop.png", "test", x_axis="pflop")
    assert (tmp_path / "curves_pflop.png").stat().st_size > 0


ROW = {"name": "simclr", "config": CONFIG, "minutes": 1, "marks": 6}


@pytest.mark.parametrize("change, message", [
    ({"marks": 3}, "rows[0] (simclr): marks 3 must be an integer >= 6 (evaluations along the run"),
    ({"steps": 100}, "rows[0] (simclr): give one budget, minutes: M (of training), steps: N (optimizer steps) or "
                     "pflop: X (counted compute), not minutes and steps"),
    ({"pflop": 0.5}, "not minutes and pflop"),
    ({"minutes": None}, "give one budget, minutes: M (of training), steps: N (optimizer steps) or pflop: X (counted "
                        "compute), not none"),
    ({"minutes": -1}, "rows[0] (simclr): minutes -1 must be a positive number"),
    ({"minutes": None, "pflop": "2 PFLOP"}, "rows[0] (simclr): pflop '2 PFLOP' must be a positive number (counted "
                                           "PFLOP)"),
    ({"minutes": None, "steps": 4}, "marks 6 must be an integer >= 6 (evaluations along the run: the curve's points) "
                                    "and at most steps (4)"),
    ({"mark": 6}, "rows[0] (simclr): unknown key 'mark'; did you mean 'marks'?"),
    ({"config": "configs/pretrain/nope.yaml"}, "config 'configs/pretrain/nope.yaml' is not a file"),
    ({"overrides": ["optim.lr=-1"]}, "rows[0] (simclr): optim.lr=-1.0 must be a finite number > 0"),
    ({"overrides": "optim.lr=1"}, "overrides 'optim.lr=1' must be a list of key=value overrides"),
    ({"seeds": [0, 0]}, "seeds [0, 0] must be a list of distinct integers >= 0"),
    ({"name": "a/b"}, "rows[0]: name 'a/b' must be a folder name"),
    ({"supervised": RECIPE, "supervised_overrides": ["optim.lr=0"]}, "optim.lr=0.0 must be a finite number > 0"),
    ({"supervised_overrides": ["optim.lr=1"]}, "supervised_overrides without supervised: RECIPE"),
])
def test_a_bad_row_is_refused_naming_the_file_the_row_and_the_value(tmp_path, change, message):
    file = write_benchmark(tmp_path / "bad.yaml", [{key: value for key, value in {**ROW, **change}.items()
                                                    if value is not None}])
    with pytest.raises(LaunchError) as refused:
        load_benchmark(str(file))
    assert str(file) in str(refused.value) and message in str(refused.value), refused.value


def test_a_bad_file_or_reference_is_refused_and_the_command_writes_nothing(tmp_path, capsys):
    from launch.__main__ import main

    with pytest.raises(LaunchError, match="two rows are named simclr"):
        load_benchmark(str(write_benchmark(tmp_path / "twice.yaml", [ROW, ROW])))
    with pytest.raises(LaunchError, match=r"image_sizes \[0\] must be a list of positive integers"):
        load_benchmark(str(write_benchmark(tmp_path / "ref.yaml", [ROW], {"config": CONFIG, "image_sizes": [0]})))
    with pytest.raises(LaunchError, match="must be a mapping with a non-empty list `rows`"):
        load_benchmark(str(write_benchmark(tmp_path / "empty.yaml", [])))
    out = tmp_path / "out"
    missing = write_benchmark(tmp_path / "missing.yaml", [{**ROW, "overrides": ["data.train=nowhere.beton"]}])
    assert main(["benchmark", str(missing), "--cluster", "local", "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "row simclr: data.train=nowhere.beton does not exist" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("comparisons, message", [
    ([["simclr_hvs", "simclr"]], None),
    ([["simclr_hvs", "simclr_hsv"]], "comparisons[0]: 'simclr_hsv' is not a row of the file; did you mean "
                                     "'simclr_hvs'?"),
    ([["simclr_hvs", "references_8px"]], "comparisons[0]: 'references_8px' is a reference row"),
    ([["simclr", "simclr"]], "comparisons[0]: ['simclr', 'simclr'] compares row simclr with itself"),
    ([["simclr_hvs"]], "comparisons[0] ['simclr_hvs'] must be a pair of row names [row, baseline_row]"),
    ([["simclr_hvs", "simclr"], ["simclr_hvs", "simclr"]], "comparisons[1]: ['simclr_hvs', 'simclr'] is listed twice"),
    ("simclr_hvs", "comparisons 'simclr_hvs' must be a list of [row, baseline_row] pairs"),
])
def test_a_files_comparisons_name_two_of_its_training_rows(tmp_path, comparisons, message):
    file = write_benchmark(tmp_path / "compared.yaml", [ROW, {**ROW, "name": "simclr_hvs"}],
                           {"config": CONFIG, "image_sizes": [8]}, comparisons=comparisons)
    if message is None:
        assert load_benchmark(str(file)).comparisons == (("simclr_hvs", "simclr"),)
        return
    with pytest.raises(LaunchError) as refused:
        load_benchmark(str(file))
    assert str(refused.value).startswith(f"{file}: ") and message in str(refused.value), refused.value


def test_a_mistyped_top_level_key_is_refused_by_name(tmp_path):
    file = write_benchmark(tmp_path / "typo.yaml", [ROW], comparison=[["simclr", "simclr"]])
    with pytest.raises(LaunchError, match="unknown key 'comparison'; did you mean 'comparisons'"):
        load_benchmark(str(file))


def test_rows_runs_the_named_rows_in_the_files_order_and_an_unknown_name_is_refused_with_the_files_names(
        tmp_path, capsys):
    from launch.__main__ import main

    file = write_benchmark(tmp_path / "two.yaml", [ROW, {**ROW, "name": "simclr_hvs"}],
                           {"config": CONFIG, "image_sizes": [8]})
    rows = load_benchmark(str(file)).rows
    picked = select_rows(str(file), rows, ["simclr_hvs", "references_8px"])
    assert [row.name for row in picked] == ["references_8px", "simclr_hvs"]
    out = tmp_path / "out"
    assert main(["benchmark", str(file), "--rows", "simclr,dino", "--cluster", "local", "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{file} has no row dino (its rows: references_8px, simclr, simclr_hvs)" in err, err
    assert not out.exists()


def test_seeds_keeps_each_rows_named_seeds_leaves_out_the_rows_without_them_and_refuses_a_seed_no_row_has(
        tmp_path, capsys):
    from launch.__main__ import main

    file = write_benchmark(tmp_path / "two.yaml", [{**ROW, "seeds": [0, 1, 2]},
                                                   {**ROW, "name": "simclr_hvs", "seeds": [1]}],
                           {"config": CONFIG, "image_sizes": [8]})
    rows = load_benchmark(str(file)).rows
    assert [(row.name, row.seeds) for row in select_seeds(str(file), rows, [0, 2])] == [
        ("references_8px", (0,)), ("simclr", (0, 2))]
    assert [(row.name, row.seeds) for row in select_seeds(str(file), rows, [1])] == [("simclr", (1,)),
                                                                                     ("simclr_hvs", (1,))]
    out = tmp_path / "out"
    assert main(["benchmark", str(file), "--seeds", "1,7", "--cluster", "local", "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{file}: no row has seed 7 (the rows' seeds: 0, 1, 2)" in err, err
    assert not out.exists()


def test_a_row_found_again_with_other_settings_is_refused_and_new_seeds_are_welcome(tmp_path):
    """Refused once one of the row's runs exists (its runs would mean something else); until then, and for a row
    whose name merely begins like it, the settings may change."""
    row = Row(name="simclr", label="SimCLR", kind="pretrain", config=CONFIG, minutes=1.0, marks=6)
    check_same_benchmark(tmp_path, [row])
    check_same_benchmark(tmp_path, [Row(**{**row.__dict__, "seeds": (0, 1, 2)})])
    (tmp_path / "rows" / "simclr_hvs_seed0").mkdir(parents=True)         # another row's run
    check_same_benchmark(tmp_path, [Row(**{**row.__dict__, "minutes": 1.5})])     # not started: sized anew
    (tmp_path / "rows" / "simclr_seed1").mkdir()
    with pytest.raises(LaunchError, match=r"holds row simclr with other settings \(minutes: 1.5 there\)"):
        check_same_benchmark(tmp_path, [Row(**{**row.__dict__, "minutes": 2.0})])
    saved = json.loads((tmp_path / "benchmark.json").read_text())             # a row saved before `pflop` existed
    del saved["rows"]["simclr"]["pflop"]
    (tmp_path / "benchmark.json").write_text(json.dumps(saved))
    check_same_benchmark(tmp_path, [Row(**{**row.__dict__, "minutes": 1.5})])


def test_a_compute_budget_row_trains_the_steps_its_pflop_buy_checkpointed_at_its_marks(tmp_path):
    """pflop: X, the third budget: the run's schedules span the steps X PFLOP buy (optim.budget_pflop), its marks are
    engine.checkpoints_per_run spread over them, keyed by step as a steps budget's (every seed buys the same steps)."""
    file = write_benchmark(tmp_path / "compute.yaml", [{"name": "simclr", "config": CONFIG, "pflop": 2.5, "marks": 6},
                                                       {**ROW, "name": "supervised", "minutes": None, "pflop": 1,
                                                        "supervised": RECIPE}])
    row, supervised = load_benchmark(str(file)).rows
    assert (row.pflop, row.minutes, row.steps, row.budget()) == (2.5, None, None, "2.5 PFLOP, 6 marks")
    assert row.budget_overrides() == ["optim.budget_pflop=2.5", "engine.checkpoints_per_run=6",
                                      "engine.checkpoint_every_steps=0"]
    assert "optim.budget_pflop=1.0" in supervised.job_steps(0, tmp_path / "run")[1].argv
    stepped = points(0.1, 0.2, 0.3)
    mark_keys(row, stepped)
    assert [p["key"] for p in stepped] == [10, 20, FINAL]


def test_a_run_cut_before_95_percent_of_its_schedule_or_ending_it_before_its_minutes_is_flagged_in_the_table(tmp_path):
    """The Fashion-MNIST selection study's minutes budgets cut SimCLR's cosine at 81%, 88% and 73% of its steps, and
    the table did not say so: each run's share of its schedule (RUN_DIR/schedule.json: the schedule's steps; the steps
    it trained) is a column, a share below 95% is marked and its run listed under the finals, as is a run whose
    schedule ended before 95% of its minutes. A compute budget's runs show the PFLOP they trained."""
    from launch.benchmark_results import schedule_trained

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "schedule.json").write_text(json.dumps({"schedule_steps": 200, "steps_per_epoch": 50, "last_step": 200,
                                                       "budget_pflop": 0.0, "flops_per_step": None}))
    assert schedule_trained(run_dir, 162) == {"schedule_steps": 200, "steps": 162, "pflop": None}
    assert schedule_trained(tmp_path, 162) == {}                            # a run from before the record
    machine = {"cores": 2, "threads": 2, "load_median": 1.8, "load_max": 2.1}
    minutes = Row(name="m", label="SimCLR, 20 min", kind="pretrain", config="c", seeds=(0, 1, 2), minutes=20.0, marks=2)
    runs = [Run(0, "a", points(10.0, 20.01), machine, {"schedule_steps": 200, "steps": 162, "pflop": None}),
            Run(1, "b", points(10.0, 17.5), machine, {"schedule_steps": 200, "steps": 200, "pflop": None}),
            Run(2, "c", points(10.0, 20.02), machine, {"schedule_steps": 200, "steps": 192, "pflop": None})]
    compute = Row(name="p", label="SimCLR, 2e-5 PFLOP", kind="pretrain", config="c", seeds=(0,), pflop=2e-5, marks=2)
    counted = [Run(0, "d", points(9.0, 18.0), machine, {"schedule_steps": 200, "steps": 200, "pflop": 1.9999e-5})]
    for row, row_runs in ((minutes, runs), (compute, counted)):
        for run in row_runs:
            mark_keys(row, run.points)
    entries = summarise(minutes, runs) + summarise(compute, counted)
    assert entries[0]["schedule_share"] == [0.81, 1.0, 0.96] and entries[1]["pflop"] == 1.9999e-5
    table = markdown(entries, "made by test").splitlines()
    assert table[4].startswith("| row | budget | seeds | k-NN | linear | k-NN by seed | linear by seed | minutes "
                               "trained | PFLOP trained | schedule trained | steps |")
    assert table[6].split(" | ")[7:11] == ["19.18", "", "81% (cut), 100%, 96%", "20, 20, 20"]
    assert table[7].split(" | ")[7:10] == ["18.00", "2e-05", "100%"]
    flagged = table.index("- SimCLR, 20 min: seed 0: cut at 81% of its schedule (162 of 200 steps); seed 1: its "
                          "schedule ended after 17.50 of the budget's 20 minutes")
    assert table[flagged - 2].startswith("Flagged: runs whose schedule was cut before 95% of its steps")
    assert not any(line.startswith("- SimCLR, 2e-5 PFLOP") for line in table)


@pytest.mark.parametrize("path", sorted((ROOT / "configs/benchmarks").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_benchmark_file_loads_with_its_references_and_at_least_6_marks_a_row(path):
    rows = load_benchmark(str(path)).rows
    assert {"reference", "pretrain"} <= {row.kind for row in rows} <= {"reference", "pretrain", "supervised"}
    assert all(row.marks >= 6 for row in rows if row.kind != "reference")


def test_the_selection_study_compares_every_arm_with_none_at_its_methods_one_compute_budget_over_5_seeds():
    """configs/benchmarks/fashion_mnist_hvs_study.yaml: per method, each arm against its `none` row, both at one counted
    budget (schedules that end at it), seeds 0-4 paired; SimCLR has the four arms."""
    study = load_benchmark(str(ROOT / "configs/benchmarks/fashion_mnist_hvs_study.yaml"))
    rows = {row.name: row for row in study.rows if row.kind == "pretrain"}
    assert {name for name in rows if name.startswith("simclr")} == {f"simclr_{arm}" for arm in
                                                                     ("none", "hardest", "easiest", "all")}
    modes = {name: next((o.split("=")[1] for o in row.overrides if o.startswith("hvs.mode=")), None)
             for name, row in rows.items()}
    assert {name: mode for name, mode in modes.items() if mode} == {
        "simclr_hardest": "hard", "simclr_easiest": "easy", "simclr_all": "all", "simsiam_hardest": "hard",
        "dino_hardest": "hard"}
    assert set(study.comparisons) == {(name, name.split("_")[0] + "_none") for name in rows
                                      if not name.endswith("_none")}
    for row, baseline in study.comparisons:
        assert rows[row].pflop == rows[baseline].pflop and rows[row].minutes is None
        assert rows[row].seeds == rows[baseline].seeds == (0, 1, 2, 3, 4)


def test_every_row_of_a_long_benchmark_gets_a_colour_and_marker_of_its_own():
    """The digits file had 11 curves (13 now): matplotlib's default cycle of 10 colours gave the 11th the first's."""
    from launch.benchmark_table import curve_styles

    labels = [f"row {i}" for i in range(25)]
    styles = curve_styles(labels)
    assert len(set(styles.values())) == 25
    assert len({colour for colour, _ in list(styles.values())[:20]}) == 20        # 20 colours before a new marker
