"""The evaluation stage's refusals: a feature cache that must not answer for other data, results and plots where
they cannot be written (a full disk, a read-only filesystem), and bad options refused in one line before any work.
(The protocols, the checkpoint checks and the CLI end to end: test_eval.py.)"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from eval.__main__ import main
from eval.inputs import EvaluationInputs
from tests.eval_helpers import RESNET18_SMALL, planted_image_dataset, shuffled_batches, write_export
from tests.run_helpers import small_filesystem

REPO_ROOT = Path(__file__).resolve().parents[1]


# ============ the feature cache, and where results cannot be written ============


def write_small_beton(path: Path, seed: int, count: int = 30) -> Path:
    """`count` random 32 px images of 3 classes, written by the project's writer (raw pixels: one count, one size)."""
    import numpy as np

    from pretrain.data.writer import ArrayImageSet, write_beton

    images = np.random.default_rng(seed).integers(0, 256, (count, 32, 32, 3), dtype=np.uint8)
    write_beton(path, ArrayImageSet(lambda i: images[i], [i % 3 for i in range(count)], None), write_mode="raw",
                workers=1)
    return path


@pytest.fixture
def loads(monkeypatch) -> list[str]:
    """The files whose images the evaluation loaded, in order: each is read as planted in-memory images (FFCV's
    decoding is not what these tests are about, and costs a second per loader)."""
    loaded = []

    def in_memory_loader(self, path):
        loaded.append(Path(path).name)
        return shuffled_batches(*planted_image_dataset(40, len(loaded)), batch_size=20)

    monkeypatch.setattr(EvaluationInputs, "image_loader", in_memory_loader)
    return loaded


@pytest.fixture(scope="module")
def digits_export(tmp_path_factory, digits) -> Path:
    """A random ResNet-18 export whose config names the digits."""
    return write_export(tmp_path_factory.mktemp("export") / "backbone.pth", RESNET18_SMALL.state_dict(),
                        train=digits / "train.beton", val=digits / "val.beton")


def knn_of(export: Path, run: Path, *options: str) -> list[str]:
    return ["knn", "--checkpoint", str(export), "--run", str(run), "--ks", "5", "--image-size", "16", *options]


def one_line_error(capsys) -> str:
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1, error
    return error


def test_a_rewritten_beton_is_evaluated_again_not_answered_from_the_feature_cache(digits_export, tmp_path, loads):
    """The cache's key held the data's paths only: a .beton rewritten with other images at the same path got the
    old features back, and the old result, with exit status 0. Here the other images have the same count and the
    file the same size: only its identity (size and modification time) tells the two apart."""
    val = write_small_beton(tmp_path / "val.beton", seed=1)
    knn = knn_of(digits_export, tmp_path / "run", "--val", str(val))
    assert main(knn) == 0 and main(knn) == 0
    assert loads == ["train.beton", "val.beton"]                     # the second answered from the cache
    size = val.stat().st_size
    write_small_beton(val, seed=2)                                  # other images, as `pretrain.data write` does
    assert val.stat().st_size == size
    assert main(knn) == 0
    assert loads == ["train.beton", "val.beton"] * 2                 # extracted again, not the old features


def test_an_image_folder_has_an_identity_of_its_files(tmp_path):
    """An image folder evaluated with --val: a file rewritten or added in it is other data for the cache."""
    from eval.features import stored_identity

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "1.png").write_bytes(b"one")
    first = stored_identity(tmp_path)
    (tmp_path / "a" / "1.png").write_bytes(b"other")
    second = stored_identity(tmp_path)
    (tmp_path / "a" / "2.png").write_bytes(b"two")
    assert len({first, second, stored_identity(tmp_path)}) == 3


def test_a_full_disk_while_caching_features_is_one_line_and_leaves_no_partial_file(digits_export, tmp_path, capsys,
                                                                                   loads):
    """A real full disk (tests/run_helpers.py: small_filesystem): torch.save's "file write failed" traceback used
    to end the k-NN, and a half-written features_step*.pt stayed behind."""
    with small_filesystem(tmp_path / "disk", "64k") as disk:
        assert main(knn_of(digits_export, disk / "run")) == 2
        assert os.listdir(disk / "run" / "eval") == []                 # nothing half-written left
    error = one_line_error(capsys)
    assert f"could not write the feature cache {disk}/run/eval/features_step0000120.pt: no space left on device" \
        in error and "--no-cache" in error


def test_results_and_plots_on_a_read_only_filesystem_are_one_line_before_any_work(digits_export, tmp_path, capsys,
                                                                                  loads):
    """`eval knn --run`, `eval plot --out` and `eval watch --run` on a real read-only filesystem used to end in
    tracebacks, k-NN's after extracting every feature."""
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "knn_step0000003.json").write_text(json.dumps({"step": 3, "top1": {"20": 0.5}}))
    with small_filesystem(tmp_path / "disk", "1m", read_only=True) as read_only:
        for cache in ([], ["--no-cache"]):
            assert main(knn_of(digits_export, read_only / "run", *cache)) == 2
            assert f"cannot write {read_only}: Read-only file system" in one_line_error(capsys)
        assert loads == []
        assert main(["plot", str(run), "--out", str(read_only / "curves.png")]) == 2
        assert f"cannot write {read_only}: Read-only file system" in one_line_error(capsys)
        assert main(["watch", "--run", str(read_only)]) == 2
        assert f"cannot write {read_only}/eval: Read-only file system" in one_line_error(capsys)


# ============ bad arguments: refused before any work ============


@pytest.mark.parametrize("argv, refusal", [
    (["linear", "--batch-size", "1"], "argument --batch-size: 1 is not an integer >= 2"),
    (["linear", "--momentum", "-5"], "argument --momentum: -5 is not a number >= 0 and < 1"),
    (["linear", "--weight-decay", "-1"], "argument --weight-decay: -1 is not a number >= 0"),
    (["linear", "--lr", "1e300"], "argument --lr: 1e300 is not a number > 0 and <= 10"),
    (["linear", "--seed", "-1"], "argument --seed: -1 is not an integer >= 0"),
    (["knn", "--num-workers", "-1"], "argument --num-workers: -1 is not an integer >= 0"),
    (["knn", "--crop-fraction", "nan"], "argument --crop-fraction: 'nan' is not finite"),
])
def test_bad_options_of_a_protocol_are_refused_before_the_features_are_extracted(digits_export, tmp_path, capsys,
                                                                                  argv, refusal):
    """`eval linear --momentum -5` used to extract every feature (16 s on the digits) and then end in SGD's
    traceback; `--batch-size 1` in the probe's, `--lr 1e300` in torch's float overflow."""
    with pytest.raises(SystemExit) as refused:
        main([*argv, "--checkpoint", str(digits_export), "--run", str(tmp_path / "run")])
    assert refused.value.code == 2 and refusal in one_line_error(capsys)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, refusal", [
    (["baselines", "--config", "CONFIG", "--image-size", "-5"], "argument --image-size: -5 is not a positive integer"),
    (["baselines", "--config", "CONFIG", "--image-size", "0"], "argument --image-size: 0 is not a positive integer"),
    (["plot", "RUN", "--out", "curves.png", "--online", "--smooth", "0"], "argument --smooth: 0 is not a positive"),
    (["plot", "RUN", "--out", "curves.png", "--online", "--smooth", "-5"], "argument --smooth: -5 is not a positive"),
    (["watch", "--run", "RUN", "--poll-seconds", "-1"], "argument --poll-seconds: -1 is not a positive number"),
    (["watch", "--run", "RUN", "--poll-seconds", "nan"], "argument --poll-seconds: 'nan' is not finite"),
])
def test_bad_options_of_baselines_plot_and_watch_are_refused_in_one_line(tmp_path, capsys, argv, refusal):
    """--image-size 0 was taken as "the config's size", -5 and --smooth 0 ended in tracebacks, --poll-seconds -1 or
    nan in time.sleep's."""
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "knn_step0000003.json").write_text(json.dumps({"step": 3, "top1": {"20": 0.5}}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 3, "monitor/online_linear_top1": 0.5}) + "\n")
    config = str(REPO_ROOT / "configs/pretrain/simclr_digits.yaml")
    argv = [{"CONFIG": config, "RUN": str(run), "curves.png": str(tmp_path / "curves.png")}.get(a, a) for a in argv]
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert refused.value.code == 2 and refusal in one_line_error(capsys)
    assert not (tmp_path / "curves.png").exists() and not (run / "eval" / "watch.lock").exists()


def test_baselines_from_a_folder_without_the_configs_data_name_the_path_before_any_work(tmp_path, capsys,
                                                                                        monkeypatch):
    """The config's data paths are relative (data/digits/train.beton): run from elsewhere, `eval baselines` used to
    end in FFCV's FileNotFoundError traceback."""
    monkeypatch.chdir(tmp_path)
    assert main(["baselines", "--config", str(REPO_ROOT / "configs/pretrain/simclr_digits.yaml")]) == 2
    error = one_line_error(capsys)
    assert f"no .beton file or image folder at data/digits/train.beton (data.train, relative to {tmp_path})" in error
    assert "data.train=FILE.beton" in error
    assert os.listdir(tmp_path) == []


def test_an_empty_or_damaged_knn_result_is_named_by_plot(tmp_path, capsys):
    """An empty knn_step*.json ended `eval plot` in json's traceback, without the file's name."""
    result = tmp_path / "run" / "eval" / "knn_step0000003.json"
    result.parent.mkdir(parents=True)
    for text, reason in [("", "it is empty"), ('{"step": 3}', "it has no top1"), ("[1, 2", "it is not JSON")]:
        result.write_text(text)
        assert main(["plot", str(tmp_path / "run"), "--out", str(tmp_path / "curves.png")]) == 2
        assert f"{result} is not a k-NN result ({reason}" in one_line_error(capsys)
    assert not (tmp_path / "curves.png").exists()
