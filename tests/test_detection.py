"""Tests of the embedded detection stage: the digit-scenes generator, COCO mAP through the command's own
evaluation function, and `python -m transfer detection` end to end on a tiny set."""
from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from pretrain.data.digits import digits_images, digits_split
from pretrain.models import create_backbone
from pretrain.runtime.optim import schedules_from_config
from transfer.__main__ import main
from transfer.detection.coco_metrics import coco_box_metrics
from transfer.detection.config import load_detection_config
from transfer.detection.task import detection_backbone
from transfer.detector import OnePixelConv2d, ResNetC5BoxHead
from transfer.digit_scenes import (DigitScenesError, render_moved_digit, render_scene, scene_generator, split_glyphs,
                                   write_digit_scenes, write_moved_digits)
from eval.features import load_backbone_export

TINY_SET = dict(num_train=12, num_val=8, image_size=64, seed=0)


@pytest.fixture(scope="module")
def tiny_scenes(tmp_path_factory) -> dict:
    return write_digit_scenes(tmp_path_factory.mktemp("scenes"), **TINY_SET)


# ============ the generated set ============


def test_boxes_lie_in_the_image_and_are_tight_around_the_pasted_ink():
    glyphs = split_glyphs("train")
    size, checked = 96, 0
    for index in range(25):
        scene = render_scene(scene_generator(7, "train", index), glyphs, size)
        assert len(scene.digits) >= 1
        changed = np.abs(scene.image.astype(int) - scene.background.astype(int)).max(axis=2) > 0
        inside_some_box = np.zeros((size, size), dtype=bool)
        for digit in scene.digits:
            x, y, w, h = digit.box
            assert 0 <= x and 0 <= y and w >= 1 and h >= 1 and x + w <= size and y + h <= size
            inside_some_box[y:y + h, x:x + w] = True
            # the generator's record: the cell's inked pixels, in image coordinates
            cx, cy, side = digit.cell
            ink = np.zeros((size, size), dtype=bool)
            ink[cy:cy + side, cx:cx + side] = digit.opacity > 0
            rows, cols = np.nonzero(ink.any(axis=1))[0], np.nonzero(ink.any(axis=0))[0]
            assert (cols[0], rows[0], cols[-1] - cols[0] + 1, rows[-1] - rows[0] + 1) == (x, y, w, h)  # tight
            # the pasted colour is visible: some pixel of the box moved well away from the background
            region = (slice(y, y + h), slice(x, x + w))
            assert np.abs(scene.image[region].astype(int) - scene.background[region].astype(int)).max() > 60
            checked += 1
        # re-rendered image against its own background: nothing outside the boxes was touched by a paste
        assert not (changed & ~inside_some_box).any()
        for a in scene.digits:   # ink boxes never overlap, so every box holds one whole, unoccluded digit
            for b in scene.digits:
                if a is not b:
                    assert (a.box[0] + a.box[2] <= b.box[0] or b.box[0] + b.box[2] <= a.box[0]
                            or a.box[1] + a.box[3] <= b.box[1] or b.box[1] + b.box[3] <= a.box[1])
    assert checked >= 50


def test_moved_digits_hold_every_digit_of_each_split_once_moved_scaled_and_recoloured(tmp_path):
    from pretrain.data.loader import build_image_loader

    paths = write_moved_digits(tmp_path, image_size=32)
    for split, path in paths.items():
        glyphs = split_glyphs(split)
        loader = build_image_loader(path, 32, 512, mean=(0, 0, 0), std=(1, 1, 1), num_workers=1, crop_fraction=1.0)
        labels = torch.cat([batch_labels for _, batch_labels, _ in loader])
        assert labels.tolist() == glyphs.labels.tolist()          # every digit of the split, in order, once
    # the glyph lands at different places and sizes: the ink's bounding boxes vary, and all lie in the image
    boxes = set()
    glyphs = split_glyphs("val")
    for index in range(40):
        rng = np.random.default_rng([0, 11, index])
        image = render_moved_digit(rng, glyphs.opacity[index], 32)
        background = render_moved_digit(np.random.default_rng([0, 11, index]), np.zeros_like(glyphs.opacity[index]), 32)
        changed = np.abs(image.astype(int) - background.astype(int)).max(axis=2) > 60
        rows, cols = np.nonzero(changed.any(axis=1))[0], np.nonzero(changed.any(axis=0))[0]
        assert len(rows) and len(cols)                              # the digit is visible on its clutter
        boxes.add((int(cols[0]) // 4, int(rows[0]) // 4, int(cols[-1] - cols[0]) // 4))
    assert len(boxes) > 20
    assert write_moved_digits(tmp_path, image_size=32) == paths     # complete files are kept


def test_written_json_matches_the_rendered_scenes_and_splits_do_not_share_digits(tiny_scenes):
    from pycocotools.coco import COCO

    _, labels = digits_images()
    train_split, val_split = (set(indices.tolist()) for indices in digits_split(labels))
    for split, allowed in (("train", train_split), ("val", val_split)):
        coco_json = json.loads(tiny_scenes[f"{split}_json"].read_text())
        assert [c["name"] for c in coco_json["categories"]] == [str(d) for d in range(10)]
        assert [c["id"] for c in coco_json["categories"]] == list(range(1, 11))
        glyphs = split_glyphs(split)
        for record in coco_json["images"]:
            index = record["id"] - 1
            scene = render_scene(scene_generator(TINY_SET["seed"], split, index), glyphs, TINY_SET["image_size"])
            annotations = [a for a in coco_json["annotations"] if a["image_id"] == record["id"]]
            assert [a["bbox"] for a in annotations] == [list(d.box) for d in scene.digits]
            assert [a["category_id"] for a in annotations] == [d.digit + 1 for d in scene.digits]
            assert [a["digit_index"] for a in annotations] == [d.digit_index for d in scene.digits]
            assert all(a["area"] == a["bbox"][2] * a["bbox"][3] and a["iscrowd"] == 0 for a in annotations)
            assert all(labels[a["digit_index"]] == a["category_id"] - 1 for a in annotations)
            assert {a["digit_index"] for a in annotations} <= allowed          # no digit image leaks across splits
            jpeg = cv2.cvtColor(cv2.imread(str(tiny_scenes[f"{split}_images"] / record["file_name"])), cv2.COLOR_BGR2RGB)
            assert jpeg.shape == (record["height"], record["width"], 3)
            assert np.abs(jpeg.astype(float) - scene.image).mean() < 4       # the file is that scene (JPEG q95)
        coco = COCO(str(tiny_scenes[f"{split}_json"]))
        assert len(coco.getImgIds()) == TINY_SET[f"num_{split}"] and len(coco.getAnnIds()) >= TINY_SET[f"num_{split}"]


def test_same_seed_gives_the_same_set_and_complete_sets_are_kept_or_refused(tmp_path, tiny_scenes):
    again = write_digit_scenes(tmp_path / "again", **TINY_SET)
    other = write_digit_scenes(tmp_path / "other", **{**TINY_SET, "seed": 1})
    for split in ("train", "val"):
        assert again[f"{split}_json"].read_bytes() == tiny_scenes[f"{split}_json"].read_bytes()
        for image in sorted(tiny_scenes[f"{split}_images"].iterdir()):
            assert (again[f"{split}_images"] / image.name).read_bytes() == image.read_bytes()
        assert other[f"{split}_json"].read_text() != again[f"{split}_json"].read_text()
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == ["train", "train.json", "val", "val.json"]
    stamp = again["train_json"].stat().st_mtime_ns
    assert write_digit_scenes(tmp_path / "again", **TINY_SET)["written"] is False
    assert again["train_json"].stat().st_mtime_ns == stamp
    with pytest.raises(DigitScenesError, match=r"other parameters: train.seed=0 \(asked 1\).*--force"):
        write_digit_scenes(tmp_path / "again", **{**TINY_SET, "seed": 1})
    forced = write_digit_scenes(tmp_path / "again", **{**TINY_SET, "seed": 1}, force=True)
    assert forced["written"] is True
    assert forced["val_json"].read_bytes() == other["val_json"].read_bytes()
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == ["train", "train.json", "val", "val.json"]


# ============ COCO mAP through the command's evaluation function ============


def test_perfect_detections_score_map_1_and_shifted_ones_far_lower(tiny_scenes):
    annotations = json.loads(tiny_scenes["val_json"].read_text())["annotations"]
    perfect = [{"image_id": a["image_id"], "category_id": a["category_id"], "bbox": a["bbox"], "score": 1.0}
               for a in annotations]
    metrics, summary = coco_box_metrics(tiny_scenes["val_json"], perfect)
    assert metrics["map"] == 1.0 and metrics["ap50"] == 1.0 and "Average Precision" in summary
    shifted = [{**d, "bbox": [d["bbox"][0] + d["bbox"][2], d["bbox"][1], d["bbox"][2], d["bbox"][3]]} for d in perfect]
    metrics, _ = coco_box_metrics(tiny_scenes["val_json"], shifted)
    assert metrics["map"] < 0.05 and metrics["ap50"] < 0.05
    wrong_class = [{**d, "category_id": d["category_id"] % 10 + 1} for d in perfect]
    assert coco_box_metrics(tiny_scenes["val_json"], wrong_class)[0]["map"] < 0.05
    assert coco_box_metrics(tiny_scenes["val_json"], [])[0] == {name: 0.0 for name in metrics}


def test_map_of_half_the_objects_found_equals_the_101_point_closed_form(tiny_scenes):
    """Every other object of each class detected exactly (score 1): precision is 1 up to recall k/n and there
    is no detection beyond, so each class's AP is #{r in 0, 0.01, ..., 1 : r <= k/n} / 101 at every IoU."""
    annotations = json.loads(tiny_scenes["val_json"].read_text())["annotations"]
    by_class: dict[int, list[dict]] = {}
    for a in annotations:
        by_class.setdefault(a["category_id"], []).append(a)
    detections, expected = [], []
    recall_points = np.linspace(0.0, 1.0, 101)
    for category, objects in by_class.items():
        found = objects[::2]
        detections += [{"image_id": a["image_id"], "category_id": category, "bbox": a["bbox"], "score": 1.0}
                       for a in found]
        expected.append(float(np.sum(recall_points <= len(found) / len(objects))) / 101)
    metrics, _ = coco_box_metrics(tiny_scenes["val_json"], detections)
    assert math.isclose(metrics["map"], sum(expected) / len(expected), rel_tol=1e-9)
    assert math.isclose(metrics["ap50"], metrics["map"], rel_tol=1e-9)
    assert metrics["map"] < 0.9


# ============ the command ============


def write_export(run_dir: Path, arch: str = "resnet18", stem: str = "small_stride2", step: int = 42) -> Path:
    """A backbone.pth in the format of pretrain/export.py export_backbone (random weights)."""
    torch.manual_seed(3)
    backbone = create_backbone(arch, stem, 32)
    config = {"data": {"mean": [0.25, 0.25, 0.25], "std": [0.35, 0.35, 0.35], "views": [{"count": 2, "size": 32}]},
              "model": {"arch": arch, "stem": stem}}
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"arch": arch, "stem": stem, "state_dict": backbone.state_dict(), "config": config, "epoch": 2,
                "step": step}, run_dir / "backbone.pth")
    return run_dir / "backbone.pth"


def read_scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(tb_dir))
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def test_detector_starts_from_the_export_or_from_random_init(tmp_path):
    export = load_backbone_export(write_export(tmp_path / "run"))
    exported = detection_backbone(export, "export", seed=0).state_dict()
    random_init = detection_backbone(export, "random", seed=0).state_dict()
    assert exported.keys() == random_init.keys() == export.backbone.state_dict().keys()
    assert all(torch.equal(exported[k], v) for k, v in torch.load(export.path, weights_only=True)["state_dict"].items())
    assert not torch.equal(exported["layer3.0.conv1.weight"], random_init["layer3.0.conv1.weight"])


@pytest.mark.parametrize("in_channels, kernel, stride, padding, side", [
    (6, 3, 1, 1, 1), (6, 3, 2, 1, 2), (6, 1, 2, 0, 2), (6, 3, 2, 1, 1), (6, 3, 1, 0, 3), (6, 3, 1, 1, 2)])
def test_one_pixel_convolution_equals_the_padded_convolution(in_channels, kernel, stride, padding, side):
    """The box head's fast path (1 x 1 outputs) and its fallback (the 2 x 2 output of the last case) give
    torch's convolution and its gradients, in float64."""
    torch.manual_seed(0)
    reference = torch.nn.Conv2d(in_channels, 5, kernel, stride, padding, bias=True).double()
    fast = torch.nn.Conv2d(in_channels, 5, kernel, stride, padding, bias=True).double()
    fast.load_state_dict(reference.state_dict())
    fast.__class__ = OnePixelConv2d
    x = torch.randn(4, in_channels, side, side, dtype=torch.float64, requires_grad=True)
    x_reference = x.detach().clone().requires_grad_(True)
    out, out_reference = fast(x), reference(x_reference)
    assert out.shape == out_reference.shape and torch.allclose(out, out_reference, atol=1e-12)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    (out_reference * weights).sum().backward()
    assert torch.allclose(x.grad, x_reference.grad, atol=1e-12)
    assert torch.allclose(fast.weight.grad, reference.weight.grad, atol=1e-12)
    assert torch.allclose(fast.bias.grad, reference.bias.grad, atol=1e-12)


def test_c4_box_head_is_layer4_and_pooling_of_the_backbone():
    torch.manual_seed(0)
    resnet = create_backbone("resnet18", "small_stride2").double().train()
    untouched = create_backbone("resnet18", "small_stride2").double().train()
    untouched.load_state_dict(resnet.state_dict())
    rois = torch.randn(16, 256, 2, 2, dtype=torch.float64)
    head = ResNetC5BoxHead(resnet)
    assert torch.allclose(head(rois), untouched.layer4(rois).mean(dim=(2, 3)), atol=1e-10)


def test_lr_schedule_warms_up_linearly_then_follows_a_cosine():
    cfg = load_detection_config(None, ["optim.lr=0.1", "optim.epochs=2", "optim.warmup_epochs=0.6"])
    lrs = schedules_from_config(cfg, steps_per_epoch=7, schedule_steps=14, global_batch=8).lr   # 4 warm-up steps of 14
    assert np.allclose(lrs[:4], 0.1 * (0.001 + 0.999 * np.arange(4) / 4))
    assert np.allclose(lrs[4:], 0.05 * (1 + np.cos(np.pi * np.arange(10) / 10)))


def test_scene_loader_resumes_mid_epoch_with_the_same_batches_and_shards_each_global_batch(tiny_scenes):
    """Resuming at batch k of epoch e reads what the uninterrupted epoch read from batch k on; each epoch is a new
    permutation; two ranks split each global batch without overlap."""
    from transfer.detection.scenes import SceneLoader, load_split

    split = load_split(tiny_scenes["train_json"], tiny_scenes["train_images"])
    cpu = torch.device("cpu")
    loader = SceneLoader(split, batch_size=4, seed=3, rank=0, world_size=1, device=cpu)
    assert len(loader) == 3 and loader.num_images == 12

    def image_ids(batches):
        return [[int(image.sum()) for image in batch.images] for batch in batches]

    whole = image_ids(loader.epoch(1))
    assert image_ids(loader.epoch(1, start_batch=2)) == whole[2:]
    assert image_ids(loader.epoch(0)) != whole
    assert sorted(sum(whole, [])) == sorted(sum(image_ids(loader.epoch(0)), []))       # every scene once an epoch
    ranks = [SceneLoader(split, batch_size=2, seed=3, rank=r, world_size=2, device=cpu) for r in (0, 1)]
    shards = [image_ids(r.epoch(1)) for r in ranks]
    assert len(ranks[0]) == 3 and [a + b for a, b in zip(*shards)] == whole              # rank 0 then rank 1


def test_tiny_detection_run_writes_cocoeval_results_and_tensorboard(tmp_path, tiny_scenes, capsys):
    run_dir = tmp_path / "run"
    write_export(run_dir, step=42)
    tiny = ["--device", "cpu", f"data.root={tiny_scenes['root']}", *(f"data.{k}={v}" for k, v in TINY_SET.items()),
            "data.batch_size=4", "engine.max_steps=3", "optim.warmup_epochs=0.7", "engine.print_every_steps=1",
            "engine.log_every_steps=1", "data.eval_batch_size=8"]
    environment = dict(os.environ)
    assert main(["detection", "--run", str(run_dir), *tiny]) == 0
    assert main(["detection", "--run", str(run_dir), "--from", "random", *tiny, "engine.max_steps=2"]) == 0
    # The process group of one is gone with its launcher variables: later runs started from this process (other
    # tests' subprocesses) must not share its MASTER_PORT.
    assert dict(os.environ) == environment
    captured = capsys.readouterr()
    assert "step 3/3" in captured.err and "Average Precision  (AP) @[ IoU=0.50:0.95" in captured.out
    scalars = read_scalars(run_dir / "tb")
    for init, tag, iterations in (("export", "eval/detection_", 3), ("random", "eval/detection_random_", 2)):
        result = json.loads((run_dir / "eval" / f"detection_{init}_step0000042.json").read_text())
        assert result["from"] == init and result["step"] == 42 and result["iterations"] == iterations
        assert result["iterations_per_epoch"] == 3 and result["num_train"] == 12 and result["num_val"] == 8
        for key in ("map", "ap50"):
            assert math.isfinite(result[key]) and 0.0 <= result[key] <= 1.0
            assert scalars[tag + key] == [(42, pytest.approx(result[key]))]
        assert result["coco_stats"]["map"] == result["map"] and len(result["coco_stats"]) == 12
        detections = json.loads(Path(result["detections"]).read_text())
        assert Path(result["detections"]).parent == run_dir / "eval" and len(detections) == result["num_detections"]
        assert all(set(d) == {"image_id", "category_id", "bbox", "score"} and 1 <= d["category_id"] <= 10
                   for d in detections)
        # the cap COCOeval's AP was computed under is named with it; no image has more detections than the cap
        cap = result["max_detections_per_image"]
        assert cap == result["config"]["model"]["box_detections_per_img"]
        assert max(Counter(d["image_id"] for d in detections).values(), default=0) <= cap

    # A re-run of a finished detection run evaluates again without training: no TensorBoard point is duplicated,
    # neither the result's nor the training curves'.
    assert main(["detection", "--run", str(run_dir), *tiny]) == 0
    assert "step 1/3" not in capsys.readouterr().err
    again = read_scalars(run_dir / "tb")
    assert again["eval/detection_map"] == scalars["eval/detection_map"]
    curves = read_scalars(run_dir / "detection" / "detection_export_step0000042" / "tb")
    assert curves and all(len({step for step, _ in points}) == len(points) == 3 for tag, points in curves.items()
                          if tag.startswith("train/")), curves


def test_bad_inputs_are_refused_in_one_line_with_status_2(tmp_path, tiny_scenes, capsys):
    data = [f"data.root={tiny_scenes['root']}", *(f"data.{k}={v}" for k, v in TINY_SET.items())]

    def refused(argv: list[str]) -> str:
        assert main(argv) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and error.startswith("error: ") and "Traceback" not in error
        return error

    assert "no backbone export at" in refused(["detection", "--run", str(tmp_path / "nowhere"), *data])
    vit_run = tmp_path / "vit"
    write_export(vit_run, arch="vit_tiny_patch16_224", stem="imagenet")
    assert "'vit_tiny_patch16_224' backbone; the detection command supports ResNets" in refused(
        ["detection", "--run", str(vit_run), *data])
    run_dir = tmp_path / "run"
    write_export(run_dir)
    assert f"no digit scenes at {tmp_path / 'missing'}" in refused(
        ["detection", "--run", str(run_dir), f"data.root={tmp_path / 'missing'}", "data.generate=false"])
    assert "other parameters: train.num_images=12 (asked 99)" in refused(
        ["detection", "--run", str(run_dir), *data, "data.num_train=99"])
    assert "did you mean 'optim.epochs'" in refused(["detection", "--run", str(run_dir), *data, "optim.epoch=1"])
    assert "did you mean 'optim.epochs'" in refused(["detection", "--run", str(run_dir), *data, "train.epochs=1"])
    assert "invalid value for optim.epochs: Value 'two'" in refused(["detection", "--run", str(run_dir), *data, "optim.epochs=two"])
    assert "optim.lr=0.0 must be" in refused(["detection", "--run", str(run_dir), *data, "optim.lr=0"])
    assert "does not exist" in refused(["detection", "--run", str(run_dir), "--config", str(tmp_path / "no.yaml")])
    assert "image_size=16" in refused(["digit-scenes", "--out-dir", str(tmp_path / "s"), "--image-size", "16"])
    assert "seed=-1 must be" in refused(["detection", "--run", str(run_dir), *data, "seed=-1"])
    assert not (run_dir / "eval").exists()
