"""Fashion-MNIST, the public benchmark: the IDX files Debian installs, read and checked; bad files refused by
name with the install command and nothing written; a tiny pretraining run on the written set, evaluated.
`make install` installs the files (Debian's dataset-fashion-mnist), as it installs FFCV's libraries."""
import gzip
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from pretrain.data.fashion_mnist import CLASS_NAMES, FASHION_MNIST_DIR, SPLITS, held_out, read_fashion_mnist
from tests.run_helpers import ROOT, run


def test_the_installed_files_hold_60000_and_10000_balanced_images():
    splits = read_fashion_mnist()
    for split, (_, _, count) in SPLITS.items():
        images, labels = splits[split]
        assert images.shape == (count, 28, 28) and images.dtype == np.uint8
        assert np.bincount(labels).tolist() == [count // 10] * 10        # 6,000 / 1,000 per class
    assert 70 < splits["train"][0].mean() < 75                           # the published mean, 72.9 (0.286)


def test_the_search_holds_out_a_sixth_of_each_class_the_same_every_time():
    labels = read_fashion_mnist()["train"][1]
    validation = held_out(labels)
    assert np.bincount(labels[validation]).tolist() == [1000] * 10        # 10,000, as many as test
    assert np.array_equal(validation, held_out(labels))                   # fixed: every checkout holds out these
    few = labels[:320]
    assert np.bincount(few[held_out(few)], minlength=10).tolist() == [n // 6 for n in np.bincount(few)]


def write(source: Path, out: Path, *extra: str, expect: int = 0):
    return run([sys.executable, "-m", "pretrain.data", "write-fashion-mnist", "--out-dir", str(out),
                "--source-dir", str(source), *extra], expect=expect)


@pytest.fixture()
def source(tmp_path) -> Path:
    """A copy of the installed IDX files, to damage."""
    copy = tmp_path / "idx"
    shutil.copytree(FASHION_MNIST_DIR, copy)
    return copy


@pytest.mark.parametrize("damage", ["missing", "truncated", "not_gzip", "foreign", "wrong_count"])
def test_a_bad_file_is_named_with_the_install_command_and_nothing_is_written(source, tmp_path, damage):
    # the test labels: the last file read, so the train split would have been written by a writer that wrote
    # as it read
    bad = source / SPLITS["test"][1]
    if damage == "missing":
        bad.unlink()
    elif damage == "truncated":
        bad.write_bytes(bad.read_bytes()[:-100])
    elif damage == "not_gzip":
        bad.write_bytes(b"<html>404 Not Found</html>")
    elif damage == "foreign":                                            # an images file under the labels' name
        shutil.copy(source / SPLITS["test"][0], bad)
    else:                                                                # a well-formed IDX file of 9,999 labels
        labels = gzip.decompress(bad.read_bytes())
        bad.write_bytes(gzip.compress(labels[:4] + (9999).to_bytes(4, "big") + labels[8:-1]))
    out = tmp_path / "out"
    result = write(source, out, expect=2)
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("error: ") and str(bad) in message and "dataset-fashion-mnist" in message, message
    assert not out.exists() or not list(out.iterdir())


@pytest.mark.slow
def test_a_tiny_benchmark_run_trains_and_is_evaluated_on_the_written_test_set(tmp_path):
    """The writer with --limit, then a few steps of the benchmark's SimCLR config with both online monitors,
    then k-NN on the written test images, then the learning-curve plot."""
    data = tmp_path / "fashion_mnist"
    written = write(FASHION_MNIST_DIR, data, "--limit", "320")
    assert "wrote 320 images in 10 classes" in written.stdout
    assert json.loads((data / "train.classes.json").read_text()) == CLASS_NAMES
    # the search's split of those training images: the held-out ones and the rest
    searched = int(held_out(read_fashion_mnist()["train"][1][:320]).sum())
    assert f"search_val.beton: wrote {searched} images" in written.stdout
    assert f"search_train.beton: wrote {320 - searched} images" in written.stdout
    # a folder written before the search's splits existed gets them and keeps the others
    train_written = (data / "train.beton").stat().st_mtime_ns
    for split in ("search_train", "search_val"):
        (data / f"{split}.beton").unlink()
    again = write(FASHION_MNIST_DIR, data, "--limit", "320")
    assert f"{data / 'train.beton'}: exists, kept" in again.stdout
    assert f"search_val.beton: wrote {searched}" in again.stdout
    assert (data / "train.beton").stat().st_mtime_ns == train_written
    run_dir = tmp_path / "run"
    run([sys.executable, "-m", "pretrain", "--config", str(ROOT / "configs/pretrain/simclr_fashion_mnist.yaml"),
         f"run_dir={run_dir}", f"data.train={data / 'train.beton'}", f"data.val={data / 'test.beton'}",
         "data.batch_size=32", "model.proj_hidden_dim=64", "optim.epochs=1", "engine.max_steps=4",
         "engine.image_grid_every_steps=0", "engine.log_every_steps=1"])
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in logged] == [1, 2, 3, 4]
    for line in logged:
        assert 1.0 <= line["monitor/rankme"] <= 32.0
        assert 0.0 <= line["monitor/online_linear_top1"] <= 1.0
    knn = run([sys.executable, "-m", "eval", "knn", "--run", str(run_dir), "--ks", "20"])
    assert "top-1" in knn.stdout
    result = json.loads(next((run_dir / "eval").glob("knn_step*.json")).read_text())
    assert 0.3 < result["top1"]["20"] <= 1.0             # 10 classes: chance is 0.1; 320 test images scored

    # the learning-curve plot of the run's results; a run without any is refused by name
    png = tmp_path / "curves.png"
    plotted = run([sys.executable, "-m", "eval", "plot", str(run_dir), "--online", "--out", str(png)])
    assert f"run: 1 k-NN point(s), last {100 * result['top1']['20']:.2f}% at step 4" in plotted.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # the anchors of `eval baselines` as horizontal lines; a folder without them is refused by name
    baselines = tmp_path / "baselines"
    (baselines / "eval").mkdir(parents=True)
    (baselines / "eval/baselines_step0000000.json").write_text(json.dumps(
        {"raw_pixels": {"knn": 0.8557, "linear": 0.8392}, "random_init": {"knn": 0.8209, "linear": 0.8345}}))
    run([sys.executable, "-m", "eval", "plot", str(run_dir), "--baselines", str(baselines), "--out", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    refused = run([sys.executable, "-m", "eval", "plot", str(run_dir), "--baselines", str(tmp_path), "--out",
                   str(png)], expect=2)
    assert "python -m eval baselines" in refused.stderr
    (tmp_path / "empty").mkdir()
    refused = run([sys.executable, "-m", "eval", "plot", str(tmp_path / "empty"), "--out", str(png)], expect=2)
    assert "has no k-NN result" in refused.stderr and "python -m eval watch" in refused.stderr
