"""The demo reads each stage's result file, not the files written next to it (launch/demo.py)."""
import json

from launch.demo import newest_result


def test_newest_result_is_the_newest_result_file_not_the_detections_next_to_it(tmp_path):
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    for step, value in ((9, 0.1), (165, 0.8)):
        (eval_dir / f"detection_export_step{step:07d}.json").write_text(json.dumps({"map": value}))
        (eval_dir / f"detection_export_step{step:07d}_detections.json").write_text(json.dumps([{"score": 1.0}]))
    (eval_dir / "detection_random_step0000200.json").write_text(json.dumps({"map": 0.5}))
    assert newest_result(tmp_path, "detection_export") == {"map": 0.8}
    assert newest_result(tmp_path, "detection_random") == {"map": 0.5}
