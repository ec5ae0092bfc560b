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


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # tensorboard's thread's own report
def test_a_result_on_a_full_disk_names_the_file_and_leaves_nothing_half_written(tmp_path):
    """A real full disk (tests/eval_helpers.py: small_filesystem). A small write finds the disk full only when it is
    flushed, in an OSError that names no file (and tensorboard's writer thread names none either): `python -m eval`
    said "cannot write None"."""
    import errno

    from pretrain.runtime.atomic_write import write_text_atomically
    from tests.eval_helpers import small_filesystem

    with small_filesystem(tmp_path / "disk", "64k") as disk:
        with pytest.raises(OSError):
            (disk / "filler").write_bytes(bytes(100_000))            # the disk is full
        with pytest.raises(OSError) as full:
            write_text_atomically(disk / "result.json", "{}")
        assert (full.value.errno, full.value.filename) == (errno.ENOSPC, str(disk / "result.json"))
        with pytest.raises(OSError) as full:
            write_result(disk / "run", "knn", 42, {"top1": 0.5}, {"eval/knn_top1": 0.5})
        assert (full.value.errno, full.value.filename) == (errno.ENOSPC, str(disk / "run" / "tb"))
        assert sorted(os.listdir(disk)) == ["filler", "run"]
        assert not (disk / "run" / "eval" / "knn_step0000042.json").exists()


def test_the_results_table_is_read_from_what_the_runs_wrote(tmp_path, capsys):
    """`python -m eval table`: method and selection from config.yaml, the final step's k-NN and linear results,
    minutes of the training clock (not of the wall clock: the run below was resumed after a day), median images/s and
    load from metrics.jsonl; an unfinished or unevaluated run is named, not shown."""
    import yaml

    from eval.__main__ import main

    def finished_run(name: str, hvs: dict, knn: float, evaluated: bool = True) -> Path:
        run = tmp_path / name
        (run / "eval").mkdir(parents=True)
        config = {"method": {"name": "simclr"}, "seed": 1, "hvs": hvs,
                  "data": {"views": [{"count": 2, "size": 16}]}}
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
        return run

    plain = finished_run("simclr", {"enabled": False}, 0.7871)
    selected = finished_run("simclr_hvs", {"enabled": True, "num_views": [4]}, 0.7994)
    assert main(["table", str(plain), str(selected), "--out", str(tmp_path / "table.md")]) == 0
    table = (tmp_path / "table.md").read_text().splitlines()
    assert table[2] == "| simclr | simclr | - | 78.71% | 83.84% | 1.5 | 340 | 1.75 |"      # the first rate left out
    assert table[3].startswith("| simclr_hvs | simclr | 6 pairs of 4 | 79.94% |")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parents[1], capture_output=True,
                            text=True).stdout.strip()
    assert table[-1].startswith(f"Made by `python -m eval table {plain} {selected} --out {tmp_path / 'table.md'}` "
                                f"at commit {commit}")                   # the command and the commit that made it
    assert json.loads((tmp_path / "table.json").read_text())[1]["seed"] == 1
    unevaluated = finished_run("late", {"enabled": False}, 0.0, evaluated=False)
    assert main(["table", str(plain), str(unevaluated)]) == 2
    assert "no knn result of its final step 468; run `python -m eval knn --run" in capsys.readouterr().err


def test_the_table_over_seeds_groups_runs_that_differ_only_in_seed(tmp_path, capsys):
    """`eval table --mean-over-seeds`: runs whose settings differ only in seed and names make one row (mean, std with
    n - 1, each seed's value); another setting makes another row; the same seed twice is refused by name."""
    import yaml

    from eval.__main__ import main

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
        return run

    runs = [finished_run("a", 0, 0.80, 0.84), finished_run("b", 1, 0.82, 0.85), finished_run("c", 2, 0.81, 0.83),
            finished_run("other_lr", 0, 0.70, 0.75, lr=0.6)]
    out = tmp_path / "seeds.md"
    assert main(["table", *map(str, runs), "--mean-over-seeds", "--out", str(out)]) == 0
    table = out.read_text().splitlines()
    assert table[2] == ("| a, b, c | simclr | - | 0, 1, 2 | 81.00% ± 1.00 | 84.00% ± 1.00 | 80.00, 82.00, 81.00 | "
                        "84.00, 85.00, 83.00 | 10.0 |")
    assert table[3].startswith("| other_lr | simclr | - | 0 | 70.00% | 75.00% |")
    assert json.loads(out.with_suffix(".json").read_text())[0]["knn"] == {"mean": 81.0, "std": 1.0,
                                                                          "values": [80.0, 82.0, 81.0]}
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
