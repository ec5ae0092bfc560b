"""eval/results.py: a result's JSON, its extra files and its TensorBoard scalars, written again without a duplicate;
on a full disk, an error that names the file."""
import json
import os

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from eval.results import feature_cache_path, result_path, write_result


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

    from pretrain.atomic_write import write_text_atomically
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
