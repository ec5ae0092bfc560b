"""The .beton writer: corrupt images skipped and reported, class order, max side, digits split, CLI errors."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("ffcv")

from pretrain.data.digits import digits_images, digits_split, write_digits
from pretrain.data.writer import classes_path, list_image_folder, skipped_report_path, write_image_folder

REPO_ROOT = Path(__file__).resolve().parents[1]


def read_fields(path: Path) -> dict[str, np.ndarray]:
    from ffcv.reader import Reader

    reader = Reader(str(path))
    return {"image_height": reader.metadata["f0"]["height"], "image_width": reader.metadata["f0"]["width"],
            "label": reader.metadata["f1"], "index": reader.metadata["f2"],
            "height": reader.metadata["f3"], "width": reader.metadata["f4"]}


@pytest.fixture
def folder_with_corrupt_images(tmp_path) -> Path:
    root = tmp_path / "images"
    rng = np.random.default_rng(0)
    for name in ("zebra", "ant"):
        (root / name).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(rng.integers(0, 255, (30 + 10 * i, 80, 3), dtype=np.uint8)).save(root / name / f"{i}.jpg")
    good = (root / "ant" / "0.jpg").read_bytes()
    (root / "ant" / "truncated.jpg").write_bytes(good[:len(good) // 3])
    (root / "zebra" / "garbage.png").write_bytes(b"this is not a png")
    return root


def test_corrupt_images_are_skipped_counted_and_listed(folder_with_corrupt_images, tmp_path):
    out = tmp_path / "out" / "train.beton"
    report = write_image_folder(folder_with_corrupt_images, out, max_side=40)
    assert report.written == 6 and len(report.skipped) == 2
    lines = skipped_report_path(out).read_text().splitlines()
    assert sorted(Path(line.split("\t")[0]).name for line in lines) == ["garbage.png", "truncated.jpg"]
    assert all(line.split("\t")[1] for line in lines)             # every line has a reason
    assert "skipped 2" in report.summary()
    assert json.loads(classes_path(out).read_text()) == ["ant", "zebra"]   # sorted folder names
    fields = read_fields(out)
    assert fields["label"].tolist() == [0, 0, 0, 1, 1, 1]
    assert fields["index"].tolist() == list(range(6))
    assert (np.maximum(fields["height"], fields["width"]) <= 40).all()
    assert (fields["height"] == fields["image_height"]).all() and (fields["width"] == fields["image_width"]).all()
    assert fields["width"][0] == 40 and fields["height"][0] == 15          # 30x80 -> 15x40: aspect kept


def test_missing_or_empty_folders_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list_image_folder(tmp_path / "nope")
    (tmp_path / "flat").mkdir()
    Image.new("RGB", (4, 4)).save(tmp_path / "flat" / "a.jpg")
    with pytest.raises(ValueError, match="no class sub-folders"):
        list_image_folder(tmp_path / "flat")
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    with pytest.raises(ValueError, match="no images"):
        list_image_folder(tmp_path / "empty")


def test_digits_split_is_stratified_and_reproducible():
    images, labels = digits_images()
    assert images.shape == (1797, 32, 32, 3) and images.dtype == np.uint8
    train, val = digits_split(labels)
    again_train, again_val = digits_split(labels)
    assert (train == again_train).all() and (val == again_val).all()
    assert len(val) == 360 and len(set(train) | set(val)) == 1797 and not set(train) & set(val)
    overall = np.bincount(labels, minlength=10) / len(labels)
    assert np.abs(np.bincount(labels[val], minlength=10) / len(val) - overall).max() < 0.01


def test_write_digits_skips_existing_files_unless_forced(tmp_path):
    reports = write_digits(tmp_path, write_mode="raw")
    assert [r.written for r in reports] == [1437, 360]
    fields = read_fields(tmp_path / "val.beton")
    _, labels = digits_images()
    _, val = digits_split(labels)
    assert fields["label"].tolist() == labels[val].tolist()
    assert [r.written for r in write_digits(tmp_path)] == [-1, -1]


def test_cli_reports_a_missing_folder_and_has_help(tmp_path):
    run = subprocess.run([sys.executable, "-m", "pretrain.data", "write", "--image-folder", str(tmp_path / "nope"),
                          "--out", str(tmp_path / "x.beton")], cwd=REPO_ROOT, capture_output=True, text=True)
    assert run.returncode == 2 and "does not exist" in run.stderr
    helped = subprocess.run([sys.executable, "-m", "pretrain.data", "write", "--help"], cwd=REPO_ROOT,
                            capture_output=True, text=True)
    assert helped.returncode == 0 and "--max-side" in helped.stdout
