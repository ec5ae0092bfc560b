"""Unlabeled data, self-supervised learning's main input: a folder of images at any depth, or a text file listing
image paths, written with label -1; every self-supervised method pretrains on it, supervised methods and the
online probe refuse it in one line, and evaluation takes a separate labelled set."""
import json
from pathlib import Path

import cv2
import numpy as np
import pytest

from pretrain.data.digits import digits_images, digits_split
from pretrain.data.writer import is_unlabeled, list_image_folder, list_unlabeled_images, write_image_folder
from tests import forked_runs

ROOT = Path(__file__).parents[1]
CONFIG = ROOT / "configs/pretrain/simclr_digits.yaml"
TINY = ["data.batch_size=32", "data.num_workers=1", "model.proj_hidden_dim=64", "model.proj_out_dim=32",
        "engine.image_grid_every_steps=0", "engine.max_steps=3", "engine.log_every_steps=1"]


def write_pngs(folder: Path, images: np.ndarray, names: list[str]) -> list[Path]:
    paths = []
    for image, name in zip(images, names):
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        cv2.imwrite(str(path), image[:, :, ::-1])
        paths.append(path)
    return paths


def dataset_labels(beton: Path) -> list[int]:
    from pretrain.data.batch_designs import dataset_labels as read_labels

    return [int(label) for label in read_labels(beton)]


def test_folders_at_any_depth_and_path_lists_are_written_with_label_minus_one(tmp_path):
    images = (np.random.default_rng(0).random((7, 12, 10, 3)) * 255).astype(np.uint8)
    nested = ["a.png", "x/b.png", "x/y/c.png", "x/y/z/d.png", "e.jpg", ".hidden/f.png", "x/.g.png"]
    write_pngs(tmp_path / "photos", images, nested)
    (tmp_path / "photos/x/notes.txt").write_text("not an image")
    listed = list_unlabeled_images(tmp_path / "photos")
    assert [p.relative_to(tmp_path / "photos").as_posix() for p in listed] == [
        "a.png", "e.jpg", "x/b.png", "x/y/c.png", "x/y/z/d.png"]                 # sorted, hidden ones left out

    report = write_image_folder(tmp_path / "photos", tmp_path / "u.beton", unlabeled=True, workers=1)
    assert report.written == 5 and "without labels (label -1)" in report.summary()
    assert dataset_labels(tmp_path / "u.beton") == [-1] * 5
    assert is_unlabeled(tmp_path / "u.beton") and json.loads((tmp_path / "u.classes.json").read_text()) == []

    # A text file of paths (relative to its folder; comments and blank lines ignored); a missing one is skipped
    # and listed, as an unreadable image is.
    listing = tmp_path / "lists/train.txt"
    listing.parent.mkdir()
    listing.write_text("# my images\n../photos/a.png\n\n../photos/x/y/c.png\n/nonexistent/img.png\n")
    report = write_image_folder(listing, tmp_path / "l.beton", unlabeled=True, workers=1)
    assert report.written == 2 and dataset_labels(tmp_path / "l.beton") == [-1, -1]
    assert [path for path, _ in report.skipped] == ["/nonexistent/img.png"]


def test_labelled_writes_name_the_unlabeled_option_instead_of_dropping_images(tmp_path):
    images = (np.random.default_rng(1).random((3, 8, 8, 3)) * 255).astype(np.uint8)
    write_pngs(tmp_path / "flat", images, ["a.png", "b.png", "c.png"])
    with pytest.raises(ValueError, match="no class sub-folders.*--unlabeled"):
        list_image_folder(tmp_path / "flat")
    # images beside class folders used to be left out without a word
    write_pngs(tmp_path / "mixed", images, ["cat/a.png", "dog/b.png", "c.png"])
    with pytest.raises(ValueError, match=r"1 image\(s\) beside its class sub-folders \(e.g. c.png\).*--unlabeled"):
        list_image_folder(tmp_path / "mixed")
    assert not is_unlabeled(tmp_path / "nothing.beton")


@pytest.mark.slow
def test_self_supervised_pretraining_on_unlabeled_images_evaluated_on_a_labelled_set(digits, tmp_path):
    """The digits' training images as a nested unlabeled folder; SimCLR pretrains on it (evaluated on the labelled
    digits); supervised TCL and the online probe refuse it in one line; eval without a labelled --train refuses."""
    images, labels = digits_images(16)
    train_indices, _ = digits_split(labels)
    names = [f"batch{i % 3}/part{i % 2}/{i:04d}.png" for i in train_indices]
    forked_runs.run("pretrain.data", ["write", "--image-folder", str(write_pngs(tmp_path / "raw", images[train_indices],
                                                                                  names)[0].parents[2]),
                                      "--out", str(tmp_path / "unlabeled.beton"), "--unlabeled"])
    assert dataset_labels(tmp_path / "unlabeled.beton") == [-1] * len(train_indices)

    run_dir = tmp_path / "run"
    common = ["--config", CONFIG, f"run_dir={run_dir}", f"data.train={tmp_path / 'unlabeled.beton'}",
              f"data.val={digits / 'val.beton'}", *TINY]
    probe = forked_runs.run("pretrain", common, expect=2)
    assert "monitor.online_probe=false" in probe.stderr and len(probe.stderr.strip().splitlines()) == 1
    supervised = forked_runs.run("pretrain", [*common, "method.name=tcl", "method.supervised=true",
                                              "monitor.online_probe=false"], expect=2)
    assert "method.name=tcl trains on class labels" in supervised.stderr
    assert not (run_dir / "checkpoints").exists()                                # refused before anything ran

    forked_runs.run("pretrain", [*common, "monitor.online_probe=false"])
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in logged] == [1, 2, 3] and "monitor/rankme" in logged[0]
    for config in ("dino_digits", "tcl_digits"):         # the methods with their own label and view paths
        other = tmp_path / config
        forked_runs.run("pretrain", ["--config", ROOT / f"configs/pretrain/{config}.yaml", f"run_dir={other}",
                                     f"data.train={tmp_path / 'unlabeled.beton'}", f"data.val={digits / 'val.beton'}",
                                     *TINY, "engine.max_steps=1",
                                     "monitor.online_probe=false", "hvs.enabled=true"])
        assert (other / "finished.json").is_file()
    refused = forked_runs.run("eval", ["knn", "--run", str(run_dir)], expect=2)
    assert "has no labels" in refused.stderr and "--train" in refused.stderr
    scored = forked_runs.run("eval", ["knn", "--run", str(run_dir), "--train", str(digits / "train.beton"),
                                      "--ks", "20"])
    # Evaluated on other training data than the run's: a result of its own name, beside the run's.
    result = json.loads(next((run_dir / "eval").glob(f"knn_on_{digits.name}-val_*_step*.json")).read_text())
    assert "top-1" in scored.stdout and result["num_train"] == len(train_indices) and result["num_val"] == 360
    assert result["top1"]["20"] > 0.5                                            # 10 classes: chance is 0.1
