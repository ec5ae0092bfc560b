"""eval/results.py: a result's JSON, its extra files and its TensorBoard scalars, written again without a duplicate."""
import json

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
