"""eval/results.py: a result's JSON, its extra files and its TensorBoard scalars, written again without a duplicate;
on a full disk, an error that names the file; a result scored otherwise than the run's own evaluation named apart."""
import json
import os
import subprocess
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from eval.results import evaluation_suffix, feature_cache_path, result_path, write_result


def test_result_extra_file_and_scalars_once_however_often_written(tmp_path):
    run = tmp_path / "run"
    detections = result_path(run, "detection_random", 42, "_detections.json")
    assert detections == run / "eval" / "detection_random_step0000042_detections.json"
    assert feature_cache_path(run, 42) == run / "eval" / "features_step0000042.pt"
    for attempt in (1, 2):               # a re-run of the same evaluation
        path = write_result(run, "detection_random", 42, {"map": 0.5 * attempt, "detections": str(detections)},
                            {"eval/detection_random_map": 0.5 * attempt}, {"_detections.json": "[]"})
        assert path == run / "eval" / "detection_random_step0000042.json"
        assert json.loads(path.read_text()) == {"map": 0.5 * attempt, "detections": str(detections)}
        assert detections.read_text() == "[]"
        scalars = EventAccumulator(str(run / "tb")).Reload().Scalars("eval/detection_random_map")
        assert [(s.step, s.value) for s in scalars] == [(42, 0.5 * attempt)]       # once, the last value
    assert sorted(p.name for p in (run / "eval").iterdir()) == [
        "detection_random_step0000042.json", "detection_random_step0000042_detections.json"]   # no temporary left


def test_a_result_on_a_full_disk_names_the_file_and_leaves_nothing_half_written(tmp_path):
    """A real full disk (tests/run_helpers.py: small_filesystem). A small write finds the disk full only when it is
    flushed, in an OSError that names no file (and tensorboard's writer thread names none either): `python -m eval`
    said "cannot write None". The writer thread also raised its copy of the error in its own thread, whose traceback
    was printed beside the one-line error (a PytestUnhandledThreadExceptionWarning in every run of the suite)."""
    import errno
    import threading

    from pretrain.runtime.atomic_write import write_text_atomically
    from tests.run_helpers import small_filesystem

    with small_filesystem(tmp_path / "disk", "64k") as disk:
        with pytest.raises(OSError):
            (disk / "filler").write_bytes(bytes(100_000))            # the disk is full
        with pytest.raises(OSError) as full:
            write_text_atomically(disk / "result.json", "{}")
        assert (full.value.errno, full.value.filename) == (errno.ENOSPC, str(disk / "result.json"))
        thread_errors = []                     # what a thread's uncaught exception would print (threading.excepthook)
        previous_hook, threading.excepthook = threading.excepthook, thread_errors.append
        try:
            with pytest.raises(OSError) as full:
                write_result(disk / "run", "knn", 42, {"top1": 0.5}, {"eval/knn_top1": 0.5})
        finally:
            threading.excepthook = previous_hook
        assert (full.value.errno, full.value.filename) == (errno.ENOSPC, str(disk / "run" / "tb"))
        assert thread_errors == []             # tensorboard's writer thread's copy of the error not printed too
        assert sorted(os.listdir(disk)) == ["filler", "run"]
        assert not (disk / "run" / "eval" / "knn_step0000042.json").exists()


def finished_run(run: Path, hvs: dict, knn: float, evaluated: bool = True, code_root: Path | None = None) -> Path:
    """A run directory as a finished, evaluated pretraining run leaves it, its start recorded from `code_root`
    (default: this checkout, as it is now); `code_root` False: a run from before provenance.json."""
    import yaml

    from pretrain.runtime.provenance import CODE_ROOT, record_start

    (run / "eval").mkdir(parents=True)
    config = {"method": {"name": "simclr"}, "seed": 1, "hvs": hvs, "data": {"views": [{"count": 2, "size": 16}]}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    (run / "finished.json").write_text(json.dumps({"step": 468, "epoch": 0}))
    (run / "eval" / "knn_step0000400.json").write_text(json.dumps({"top1": {"20": 0.5}}))      # an older one
    if evaluated:
        (run / "eval" / "knn_step0000468.json").write_text(json.dumps({"top1": {"20": knn}}))
        (run / "eval" / "linear_step0000468.json").write_text(json.dumps({"top1": 0.8384}))
    lines = [{"step": s, "time": time, "perf/images_per_s": rate, "perf/load_average_1min": load,
              "perf/training_seconds": seconds}
             for s, time, seconds, rate, load in ((1, 1000.0, 0.0, 20.0, 5.0), (2, 1030.0, 30.0, 300.0, 1.5),
                                                  (3, 87430.0, 60.0, 340.0, 2.0), (4, 87460.0, 90.0, 350.0, 1.0))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if code_root is not False:
        record_start(run, 0, code_root=code_root or CODE_ROOT)
    return run


def test_the_results_table_is_read_from_what_the_runs_wrote(tmp_path, capsys):
    """`python -m eval table`: method and selection from config.yaml, the final step's k-NN and linear results,
    minutes of the training clock (not of the wall clock: the run below was resumed after a day), median images/s and
    load from metrics.jsonl, the commit from provenance.json; an unfinished or unevaluated run is named, not shown."""
    from eval.__main__ import main
    from tests.git_checkouts import this_checkouts_label

    plain = finished_run(tmp_path / "simclr", {"enabled": False}, 0.7871)
    selected = finished_run(tmp_path / "simclr_hvs", {"enabled": True, "num_views": [4]}, 0.7994)
    assert main(["table", str(plain), str(selected), "--out", str(tmp_path / "table.md")]) == 0
    table = (tmp_path / "table.md").read_text().splitlines()
    here = this_checkouts_label(Path(__file__).parents[1])
    assert table[2] == f"| simclr | simclr | - | 78.71% | 83.84% | 1.5 | 340 | 1.75 | {here} |"   # first rate left out
    assert table[3].startswith("| simclr_hvs | simclr | 6 pairs of 4 | 79.94% |") and table[3].endswith(f"| {here} |")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parents[1], capture_output=True,
                            text=True).stdout.strip()
    assert table[-1].startswith(f"Made by `python -m eval table {plain} {selected} --out {tmp_path / 'table.md'}` "
                                f"at commit {commit}")                   # the command and the commit that made it
    written = json.loads((tmp_path / "table.json").read_text())
    assert written["rows"][1]["seed"] == 1 and written["mixed_code"] is False and written["code_warnings"] == []
    assert [code["commit"] for code in written["rows"][0]["commits"]] == [commit]
    unevaluated = finished_run(tmp_path / "late", {"enabled": False}, 0.0, evaluated=False)
    assert main(["table", str(plain), str(unevaluated)]) == 2
    assert "no knn result of its final step 468; run `python -m eval knn --run" in capsys.readouterr().err


def test_the_table_says_at_its_top_when_its_rows_mix_code_or_a_runs_code_is_unknown(tmp_path, capsys):
    """A row trained at a commit this checkout does not have (here: of another checkout) cannot be compared: the
    table's first line says the code is mixed and table.json's `mixed_code` is true; a run without provenance.json
    shows "unknown" and is named in a line of its own."""
    from eval.__main__ import main
    from tests.git_checkouts import make_checkout, this_checkouts_label

    other = make_checkout(tmp_path / "other_checkout")
    here = finished_run(tmp_path / "here", {"enabled": False}, 0.79)
    elsewhere = finished_run(tmp_path / "elsewhere", {"enabled": False}, 0.81, code_root=other)
    before = finished_run(tmp_path / "before", {"enabled": False}, 0.80, code_root=False)
    assert main(["table", str(here), str(elsewhere), str(before), "--out", str(tmp_path / "table.md")]) == 0
    printed = capsys.readouterr().out.splitlines()
    foreign = json.loads((elsewhere / "provenance.json").read_text())[0]["code"]["commit"]
    assert printed[0].startswith("Mixed code: the rows were trained at 2 code states that cannot be compared in "
                                 "training files (pretrain/, configs/, transfer/): ")
    assert f"; {foreign[:7]}: elsewhere. Not in this checkout, so not compared: {foreign[:7]}." in printed[0]
    assert printed[2] == ("Unknown code: before has runs without provenance.json (trained before runs recorded their "
                          "commit): which code trained it cannot be checked.")
    rows = [line for line in printed if line.startswith("| ")][2:]
    assert [row.rsplit("|", 2)[1].strip() for row in rows] == [
        this_checkouts_label(Path(__file__).parents[1]), foreign[:7], "unknown"]
    written = json.loads((tmp_path / "table.json").read_text())
    assert written["mixed_code"] is True and len(written["code_warnings"]) == 2
    assert written["rows"][1]["commits"][0]["commit"] == foreign and written["rows"][2]["commits"][0]["commit"] is None
    assert main(["table", str(here), str(before)]) == 0                        # unknown, not mixed
    assert capsys.readouterr().out.startswith("Unknown code: before has runs")


def test_the_table_over_seeds_groups_runs_that_differ_only_in_seed(tmp_path, capsys):
    """`eval table --mean-over-seeds`: runs whose settings differ only in seed and names make one row (mean, std with
    n - 1, the 95% t interval, each seed's value, the runs' commits); another setting makes another row; the same
    seed twice is refused by name."""
    import yaml

    from eval.__main__ import main
    from pretrain.runtime.provenance import record_start
    from tests.git_checkouts import this_checkouts_label

    def finished_run(name: str, seed: int, knn: float, linear: float, lr: float = 0.3) -> Path:
        run = tmp_path / name
        (run / "eval").mkdir(parents=True)
        config = {"name": name, "run_dir": str(run), "seed": seed, "method": {"name": "simclr"},
                  "optim": {"lr": lr}, "hvs": {"enabled": False}, "data": {"views": [{"count": 2, "size": 16}]}}
        (run / "config.yaml").write_text(yaml.safe_dump(config))
        (run / "finished.json").write_text(json.dumps({"step": 10, "epoch": 0}))
        (run / "eval" / "knn_step0000010.json").write_text(json.dumps({"top1": {"20": knn}}))
        (run / "eval" / "linear_step0000010.json").write_text(json.dumps({"top1": linear}))
        lines = [{"step": s, "time": 100.0 * s, "perf/training_seconds": 60.0 * s, "perf/images_per_s": 300.0}
                 for s in (1, 10)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        record_start(run, 0)
        return run

    runs = [finished_run("a", 0, 0.80, 0.84), finished_run("b", 1, 0.82, 0.85), finished_run("c", 2, 0.81, 0.83),
            finished_run("other_lr", 0, 0.70, 0.75, lr=0.6)]
    out = tmp_path / "seeds.md"
    assert main(["table", *map(str, runs), "--mean-over-seeds", "--out", str(out)]) == 0
    table = out.read_text().splitlines()
    here = this_checkouts_label(Path(__file__).parents[1])
    # 95% t interval of 3 values of std 1: mean -+ 4.3027 / sqrt(3) = mean -+ 2.48
    assert table[2] == ("| a, b, c | simclr | - | 0, 1, 2 | 81.00% ± 1.00, 95% CI [78.52, 83.48] | 84.00% ± 1.00, 95% "
                        f"CI [81.52, 86.48] | 80.00, 82.00, 81.00 | 84.00, 85.00, 83.00 | 10.0 | {here} |")
    assert table[3].startswith("| other_lr | simclr | - | 0 | 70.00% (1 seed: no interval) | 75.00% (1 seed: no "
                               "interval) |")
    assert json.loads(out.with_suffix(".json").read_text())["rows"][0]["knn"] == {
        "mean": 81.0, "std": 1.0, "ci95": [78.52, 83.48], "n": 3, "values": [80.0, 82.0, 81.0]}
    twice = finished_run("d", 1, 0.5, 0.5)
    assert main(["table", str(runs[1]), str(twice), "--mean-over-seeds"]) == 2
    assert "the same settings and the same seed twice ([1, 1])" in capsys.readouterr().err


def test_an_evaluation_at_another_side_crop_or_data_is_named_apart_from_the_runs_own(tmp_path):
    """The run's own settings (its data, data.eval_image_size else the views' side, data.eval_crop_fraction else
    0.875) name no suffix; each other setting adds its own, so no such result is written over the run's."""
    train, val = tmp_path / "fm/train.beton", tmp_path / "fm/test.beton"
    config = {"data": {"train": str(train), "val": str(val), "views": [{"count": 2, "size": 16}]}}
    assert evaluation_suffix(config, train, val, 16, 0.875) == ""
    assert evaluation_suffix(config, train, val, 24, 0.875) == "_at_24px"
    assert evaluation_suffix(config, train, val, 16, 1.0) == "_crop1"
    other = evaluation_suffix(config, train, tmp_path / "fm/search_val.beton", 24, 1.0)
    assert other.startswith("_on_fm-search_val_") and other.endswith("_at_24px_crop1")
    configured = {"data": {**config["data"], "eval_image_size": 24, "eval_crop_fraction": 1.0}}
    assert evaluation_suffix(configured, train, val, 24, 1.0) == ""        # the side and crop its config names
    assert evaluation_suffix(configured, train, val, 16, 0.875) == "_at_16px_crop0.875"
