"""Tests of the evaluation stage: weighted k-NN, linear probe, checkpoint checks and the `python -m eval` CLI.
(Its refusals of bad options and of places results cannot be written, and the feature cache: test_eval_refusals.py.)"""
from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eval.__main__ import main
from eval.features import EvaluationInputError, extract_features, load_backbone_export
from eval.inputs import EvaluationInputs
from eval.knn import weighted_knn
from eval.linear import cosine_learning_rate, train_linear_probe
from pretrain.models import create_backbone
from tests.eval_helpers import (RESNET18_SMALL, planted_image_dataset, read_scalars, shuffled_batches,
                                write_export)

# ============ weighted k-NN ============


def brute_force_knn(train_features, train_labels, test_features, test_labels, k, temperature):
    """One test sample at a time, in float64 Python: the DINO vote written as plainly as possible."""
    train = F.normalize(train_features.double(), dim=1)
    correct = 0
    for feature, label in zip(F.normalize(test_features.double(), dim=1), test_labels.tolist()):
        similarities = (train @ feature).tolist()
        nearest = sorted(range(len(similarities)), key=lambda i: -similarities[i])[:k]
        votes: dict[int, float] = {}
        for i in nearest:
            votes[int(train_labels[i])] = votes.get(int(train_labels[i]), 0.0) + math.exp(similarities[i] / temperature)
        best = max(votes.values())
        prediction = min(c for c, v in votes.items() if v == best)
        correct += prediction == label
    return correct / len(test_labels)


def test_weighted_knn_on_planted_clusters_gives_exact_accuracy():
    generator = torch.Generator().manual_seed(0)
    num_classes, per_class, dim = 4, 10, 16
    centres = torch.eye(dim)[:num_classes] * 10
    train_labels = torch.arange(num_classes).repeat_interleave(per_class)
    train = centres[train_labels] + 0.1 * torch.randn(len(train_labels), dim, generator=generator)
    true_test_labels = torch.arange(num_classes).repeat(5)                      # 20 test samples
    test = centres[true_test_labels] + 0.1 * torch.randn(20, dim, generator=generator)
    test_labels = true_test_labels.clone()
    test_labels[:6] = (test_labels[:6] + 1) % num_classes                       # 6 of 20 deliberately wrong
    accuracy = weighted_knn(train, train_labels, test, test_labels, ks=(5, 10, 40, 100), chunk_size=7)
    assert accuracy == {5: 14 / 20, 10: 14 / 20, 40: 14 / 20}                   # 100 is capped at 40 samples


def test_weighted_knn_weights_votes_by_similarity():
    # One very close neighbour of class 1 outvotes two distant ones of class 0 only thanks to exp(sim / T).
    train = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.6, -0.8]])
    train_labels = torch.tensor([1, 0, 0])
    test = torch.tensor([[1.0, 0.05]])
    assert weighted_knn(train, train_labels, test, torch.tensor([1]), ks=(3,)) == {3: 1.0}
    # With a large temperature the weights are nearly equal and the majority wins.
    assert weighted_knn(train, train_labels, test, torch.tensor([1]), ks=(3,), temperature=100.0) == {3: 0.0}


@pytest.mark.parametrize("chunk_size", [1, 8, 37, 1000])
def test_weighted_knn_matches_brute_force_across_chunk_boundaries(chunk_size):
    generator = torch.Generator().manual_seed(1)
    train = torch.randn(50, 8, generator=generator)
    train_labels = torch.randint(0, 4, (50,), generator=generator)
    test = torch.randn(37, 8, generator=generator)
    test_labels = torch.randint(0, 4, (37,), generator=generator)
    accuracy = weighted_knn(train, train_labels, test, test_labels, ks=(1, 5, 20, 60), temperature=0.07,
                            chunk_size=chunk_size)
    assert sorted(accuracy) == [1, 5, 20, 50]
    for k, value in accuracy.items():
        assert value == brute_force_knn(train, train_labels, test, test_labels, k, 0.07), k


def test_weighted_knn_rejects_bad_arguments_with_a_fix():
    features, labels = torch.randn(4, 3), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature=0"):
        weighted_knn(features, labels, features, labels, temperature=0)
    with pytest.raises(ValueError, match="same|one D"):
        weighted_knn(features, labels, torch.randn(2, 5), labels[:2])
    with pytest.raises(ValueError, match="without labels"):
        weighted_knn(features, -torch.ones(4, dtype=torch.long), features, labels)


# ============ linear probe ============


def test_linear_probe_learns_linearly_separable_data():
    generator = torch.Generator().manual_seed(2)
    num_classes, dim = 5, 32
    directions = torch.randn(num_classes, dim, generator=generator) * 3
    def sample(count):
        labels = torch.randint(0, num_classes, (count,), generator=generator)
        # A large shared offset and scale: the non-affine BatchNorm must standardise them away.
        return 50 + 20 * (directions[labels] + torch.randn(count, dim, generator=generator)), labels
    train_x, train_y = sample(600)
    val_x, val_y = sample(300)
    accuracy = train_linear_probe(train_x, train_y, val_x, val_y, epochs=15, batch_size=100, device="cpu")
    assert accuracy.final >= 0.95
    assert accuracy.best >= accuracy.final and 1 <= accuracy.best_epoch <= 15


def test_cosine_learning_rate_runs_from_peak_to_zero():
    assert cosine_learning_rate(0.1, 0.0) == pytest.approx(0.1)
    assert cosine_learning_rate(0.1, 0.5) == pytest.approx(0.05)
    assert cosine_learning_rate(0.1, 1.0) == pytest.approx(0.0)


# ============ features ============


def test_extract_features_returns_dataset_order_for_any_encoder():
    images = torch.randn(23, 3, 4, 4)
    labels = torch.arange(23) % 3
    features, extracted_labels = extract_features(lambda x: x, shuffled_batches(images, labels, 5), "cpu")
    assert torch.equal(features, images.flatten(1))
    assert torch.equal(extracted_labels, labels)


def test_extract_features_refuses_a_loader_that_drops_images():
    images, labels = torch.randn(10, 3, 2, 2), torch.zeros(10, dtype=torch.long)
    with pytest.raises(ValueError, match="permutation"):
        extract_features(lambda x: x, shuffled_batches(images, labels, 4)[:-1], "cpu")


# ============ checkpoint checks ============

def test_missing_checkpoint_is_refused_without_traceback(tmp_path, capsys):
    assert main(["knn", "--run", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert f"no backbone export at {tmp_path / 'backbone.pth'}" in error
    assert "python -m pretrain" in error and "--checkpoint" in error and "Traceback" not in error
    assert main(["linear", "--checkpoint", str(tmp_path / "nowhere.pth")]) == 2
    assert "no backbone export at" in capsys.readouterr().err


def test_checkpoint_with_other_stem_names_the_mismatched_keys(tmp_path):
    imagenet_stem = create_backbone("resnet18", "imagenet").state_dict()
    path = write_export(tmp_path / "backbone.pth", imagenet_stem)  # claims small_stride2
    with pytest.raises(EvaluationInputError) as error:
        load_backbone_export(path)
    message = str(error.value)
    assert "do not fit create_backbone(arch='resnet18', stem='small_stride2')" in message
    assert "conv1.weight (64, 3, 7, 7) vs (64, 3, 3, 3)" in message


def test_checkpoint_with_prefixed_keys_names_missing_and_unexpected_keys(tmp_path):
    prefixed = {f"backbone.{key}": value for key, value in RESNET18_SMALL.state_dict().items()}
    path = write_export(tmp_path / "backbone.pth", prefixed)
    with pytest.raises(EvaluationInputError) as error:
        load_backbone_export(path)
    message = str(error.value)
    assert "missing keys: conv1.weight, bn1.weight" in message
    assert "unexpected keys: backbone.conv1.weight" in message
    assert "(and " in message and "Export the backbone alone" in message


def test_checkpoint_with_unknown_arch_is_refused(tmp_path, capsys):
    write_export(tmp_path / "backbone.pth", RESNET18_SMALL.state_dict(), arch="resnet_unheard_of")
    assert main(["knn", "--run", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "cannot rebuild the backbone" in error and "'resnet_unheard_of' is not a timm model name" in error


def test_missing_beton_is_refused(tmp_path, capsys):
    write_export(tmp_path / "backbone.pth", RESNET18_SMALL.state_dict(), train=tmp_path / "missing.beton")
    assert main(["knn", "--run", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert f"no .beton file or image folder at {tmp_path / 'missing.beton'} (data.train)" in error and "--train" in error


def test_a_non_finite_export_is_refused_not_scored_at_chance(tmp_path, capsys):
    diverged = {name: value.clone() for name, value in RESNET18_SMALL.state_dict().items()}
    diverged["layer4.1.conv2.weight"][0, 0, 0, 0] = float("nan")
    diverged["fc.weight" if "fc.weight" in diverged else "layer1.0.bn1.weight"].fill_(float("inf"))
    write_export(tmp_path / "backbone.pth", diverged)
    assert main(["knn", "--run", str(tmp_path)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert "holds NaN or inf in 2 tensors" in error and "layer4.1.conv2.weight" in error and "diverged" in error


def test_data_that_is_neither_a_beton_nor_a_folder_is_refused_in_one_line(tmp_path, capsys):
    readme = Path(__file__).resolve().parents[1] / "README.md"
    write_export(tmp_path / "backbone.pth", RESNET18_SMALL.state_dict(), train=tmp_path, val=tmp_path)
    assert main(["linear", "--run", str(tmp_path), "--val", str(readme)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert f"--val {readme}" in error and "is not a .beton that FFCV can read" in error


def test_file_that_is_not_an_export_is_refused(tmp_path):
    torch.save({"model": {}}, tmp_path / "backbone.pth")
    with pytest.raises(EvaluationInputError, match="expected a dict with 'arch' and 'state_dict'"):
        load_backbone_export(tmp_path / "backbone.pth")


# ============ command line on in-memory data ============


def test_cli_linear_and_knn_on_in_memory_loader_write_json_tensorboard_and_cache(tmp_path, monkeypatch, capsys):
    (tmp_path / "train").mkdir()            # stand-ins for image folders: the loader is replaced below
    (tmp_path / "val").mkdir()
    write_export(tmp_path / "run" / "backbone.pth", RESNET18_SMALL.state_dict(), train=tmp_path / "train",
                 val=tmp_path / "val")
    splits = {"train": planted_image_dataset(96, 0), "val": planted_image_dataset(40, 1)}
    loads = []

    def in_memory_loader(self, path):
        loads.append(path.name)
        return shuffled_batches(*splits[path.name], batch_size=32)

    monkeypatch.setattr(EvaluationInputs, "image_loader", in_memory_loader)
    run = tmp_path / "run"
    assert main(["linear", "--run", str(run), "--epochs", "20", "--batch-size", "32", "--device", "cpu"]) == 0
    assert main(["knn", "--run", str(run), "--ks", "5", "20", "500", "--chunk-size", "16", "--device", "cpu"]) == 0
    assert loads == ["train", "val"]                                   # knn reused the cached features
    assert (run / "eval" / "features_step0000120.pt").is_file()

    linear = json.loads((run / "eval" / "linear_step0000120.json").read_text())
    assert linear["protocol"] == "linear" and linear["step"] == 120 and linear["epoch"] == 3
    assert linear["num_train"] == 96 and linear["num_val"] == 40
    assert linear["top1"] > 0.9                                        # the probe learned the planted quadrants
    assert linear["best_top1"] >= linear["top1"] and 1 <= linear["best_epoch"] <= 20
    knn = json.loads((run / "eval" / "knn_step0000120.json").read_text())
    assert set(knn["top1"]) == {"5", "20", "96"}                       # 500 capped at the 96 training images
    assert knn["top1"]["5"] > 0.9                                      # planted quadrants survive a random net

    scalars = read_scalars(run / "tb")
    assert scalars["eval/linear_top1"] == [(120, pytest.approx(linear["top1"]))]
    assert scalars["eval/linear_best_top1"] == [(120, pytest.approx(linear["best_top1"]))]
    assert scalars["eval/knn_top1_k20"] == [(120, pytest.approx(knn["top1"]["20"]))]
    printed = capsys.readouterr().out
    assert "weighted k-NN" in printed and "linear probe" in printed

    # The same export on other data (--val): a result and a TensorBoard section of its own; the run's stay as they
    # were. Naming the run's own data explicitly is the run's own result.
    (tmp_path / "other").mkdir()
    splits["other"] = planted_image_dataset(40, 2)
    own = (run / "eval" / "knn_step0000120.json").read_text()
    assert main(["knn", "--run", str(run), "--val", str(tmp_path / "other"), "--ks", "5", "--device", "cpu"]) == 0
    [other] = (run / "eval").glob("knn_on_*_step0000120.json")
    assert other.name.startswith(f"knn_on_{tmp_path.name}-other_")
    assert (run / "eval" / "knn_step0000120.json").read_text() == own
    assert json.loads(other.read_text())["val"] == str(tmp_path / "other")
    section = "eval" + other.name.removeprefix("knn").removesuffix("_step0000120.json")
    scalars = read_scalars(run / "tb")
    assert scalars["eval/knn_top1_k20"] == [(120, pytest.approx(knn["top1"]["20"]))]
    assert scalars[f"{section}/knn_top1_k5"] == [(120, pytest.approx(json.loads(other.read_text())["top1"]["5"]))]
    assert main(["knn", "--run", str(run), "--val", str(tmp_path / "val"), "--ks", "5", "--device", "cpu"]) == 0
    assert json.loads((run / "eval" / "knn_step0000120.json").read_text())["top1"] == {"5": knn["top1"]["5"]}
    assert len(list((run / "eval").glob("knn_*step0000120.json"))) == 2


class InMemoryViewLoader:
    """Stand-in for the pretraining view loader: one noisy copy of every image per epoch, as a ViewBatch."""

    def __init__(self, images, labels, batch_size):
        self.images, self.labels, self.batch_size = images, labels, batch_size

    def __len__(self):
        return len(self.images) // self.batch_size

    def epoch(self, epoch):
        from pretrain.data.views import ViewBatch

        generator = torch.Generator().manual_seed(epoch)
        order = torch.randperm(len(self.images), generator=generator)
        for batch in order[:len(self) * self.batch_size].split(self.batch_size):
            views = self.images[batch] + 0.1 * torch.randn(self.images[batch].shape, generator=generator)
            yield ViewBatch(views=[views[:, None]], boxes=[torch.zeros(len(batch), 1, 4)],
                            labels=self.labels[batch], indices=batch)


def test_augmented_linear_probe_trains_through_the_frozen_backbone():
    from eval.linear import train_linear_probe_on_views

    backbone = create_backbone("resnet18", "small_stride2").eval()
    train_images, train_labels = planted_image_dataset(64, 0)
    val_images, val_labels = planted_image_dataset(32, 1)
    val_features, _ = extract_features(backbone, shuffled_batches(val_images, val_labels, 16), "cpu")
    weights_before = {name: value.clone() for name, value in backbone.state_dict().items()}
    accuracy = train_linear_probe_on_views(backbone, InMemoryViewLoader(train_images, train_labels, 16),
                                           val_features, val_labels, num_classes=4, epochs=5, device="cpu")
    assert accuracy.final >= 0.9
    assert all(torch.equal(value, weights_before[name]) for name, value in backbone.state_dict().items())


# ============ end to end on the digits .beton ============

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_module(*args: str):
    """`python -m MODULE ARGS` (forked from a server that imported torch: tests/forked_runs.py)."""
    from tests import forked_runs

    return forked_runs.run(args[0], list(args[1:]), expect=None)


def test_raw_pixel_knn_on_digits_through_the_image_loader(digits):
    from pretrain.data.loader import build_image_loader

    def features(split):
        loader = build_image_loader(digits / f"{split}.beton", 32, 256, device="cpu", mean=[0.5] * 3,
                                    std=[0.25] * 3, num_workers=1)
        return extract_features(lambda images: images.flatten(1), loader, "cpu")

    train_features, train_labels = features("train")
    val_features, val_labels = features("val")
    assert (len(train_labels), len(val_labels)) == (1437, 360)
    accuracy = weighted_knn(train_features, train_labels, val_features, val_labels, ks=(20,))
    assert accuracy[20] > 0.9                                   # about 97% (ENVIRONMENT.md)


@pytest.mark.slow
def test_cli_knn_end_to_end_on_digits(digits, tmp_path):
    run = tmp_path / "run"
    write_export(run / "backbone.pth", RESNET18_SMALL.state_dict(), train=digits / "train.beton",
                 val=digits / "val.beton", step=40)
    finished = run_module("eval", "knn", "--run", str(run), "--device", "cpu", "--num-workers", "1")
    assert finished.returncode == 0, finished.stderr
    assert "weighted k-NN" in finished.stdout and "top-1" in finished.stdout

    result = json.loads((run / "eval" / "knn_step0000040.json").read_text())
    assert result["protocol"] == "knn" and result["step"] == 40 and result["epoch"] == 3
    assert result["num_train"] == 1437 and result["num_val"] == 360 and result["seconds"] > 0
    assert set(result["top1"]) == {"10", "20", "100", "200"}
    # The same random-init encoder, evaluated in this process on the same images with the same preprocessing
    # (an export without data.eval_crop_fraction: the standard 0.875 centre crop), gives the same accuracies.
    from pretrain.data.loader import build_image_loader

    def features(split):
        loader = build_image_loader(digits / f"{split}.beton", 32, 256, mean=[0.5] * 3, std=[0.25] * 3,
                                    num_workers=1, crop_fraction=0.875)
        return extract_features(RESNET18_SMALL.eval(), loader, "cpu")

    expected = weighted_knn(*features("train"), *features("val"), ks=(10, 20, 100, 200))
    assert result["top1"] == {str(k): pytest.approx(accuracy, abs=1e-9) for k, accuracy in expected.items()}
    assert result["top1"]["20"] > 0.5                           # far above chance (0.1): digits separate easily
    scalars = read_scalars(run / "tb")
    for k in (10, 20, 100, 200):
        assert scalars[f"eval/knn_top1_k{k}"] == [(40, pytest.approx(result["top1"][str(k)]))]


def test_an_export_whose_config_sets_an_evaluation_side_is_scored_at_it(few_digits, tmp_path):
    """data.eval_image_size: the evaluation's side (here 24 px against the views' 32), what `eval knn` scores at by
    default; the backbone is still rebuilt for the views' side (a ViT's position embedding)."""
    from eval.results import evaluation_image_size, trained_image_size
    from pretrain.data.loader import build_image_loader

    run = tmp_path / "run"
    path = write_export(run / "backbone.pth", RESNET18_SMALL.state_dict(), train=few_digits / "train.beton",
                        val=few_digits / "val.beton", step=40)
    export = torch.load(path, weights_only=True)
    export["config"]["data"]["eval_image_size"] = 24
    torch.save(export, path)
    assert (evaluation_image_size(export["config"]), trained_image_size(export["config"])) == (24, 32)
    finished = run_module("eval", "knn", "--run", str(run), "--device", "cpu", "--num-workers", "1", "--ks", "20")
    assert finished.returncode == 0, finished.stderr
    result = json.loads((run / "eval" / "knn_step0000040.json").read_text())

    def features(split, side):
        loader = build_image_loader(few_digits / f"{split}.beton", side, 256, mean=[0.5] * 3, std=[0.25] * 3,
                                    num_workers=1, crop_fraction=0.875)
        return extract_features(RESNET18_SMALL.eval(), loader, "cpu")

    at_24 = weighted_knn(*features("train", 24), *features("val", 24), ks=(20,))[20]
    assert result["top1"]["20"] == pytest.approx(at_24, abs=1e-9) and result["image_size"] == 24
    assert at_24 != weighted_knn(*features("train", 32), *features("val", 32), ks=(20,))[20]     # not the views' side


@pytest.mark.slow
def test_baselines_reproduce_the_demos_anchor_rows_and_write_one_result(digits, tmp_path):
    """`python -m eval baselines` on the digits config: raw pixels and the random-init ResNet-18, by k-NN and the
    linear probe, the numbers of the README's anchor rows (the demo computes them with the same function)."""
    out = tmp_path / "baselines"
    finished = run_module("eval", "baselines", "--config", str(REPO_ROOT / "configs/pretrain/simclr_digits.yaml"),
                          "--out-dir", str(out), f"data.train={digits / 'train.beton'}",
                          f"data.val={digits / 'val.beton'}")
    assert finished.returncode == 0, finished.stderr[-3000:]
    result = json.loads((out / "eval/baselines_step0000000.json").read_text())
    assert result["raw_pixels"]["knn"] == pytest.approx(0.9722, abs=1e-4)       # README: 97.22% / 95.83%
    assert result["raw_pixels"]["linear"] == pytest.approx(0.9583, abs=1e-4)
    assert result["random_init"]["knn"] == pytest.approx(0.9194, abs=1e-4)      # README: 91.94% / 95.28%
    assert result["random_init"]["linear"] == pytest.approx(0.9528, abs=1e-4)
    assert "raw_pixels" in finished.stdout and "97.22%" in finished.stdout
    # beside them, the standard reference (tests/test_standardised_pixels.py): the gray digits' 16 x 16 pixels once,
    # the choices made on a sixth of the 1,437 training images and recorded with their grids
    standard = result["standardised_pixels"]
    assert (standard["channels"], standard["features"], standard["train_images"]) == (1, 256, 1437)
    assert standard["validation_images"] == 236 and standard["warnings"] == []
    assert standard["logistic_regression"]["C"] in standard["logistic_regression"]["grid"]
    assert len(standard["k_nearest_neighbours"]["validation"]) == 6 and 0.9 < standard["linear"] <= 1
    assert f"standardised_pixels     {standard['knn']:.2%}" in finished.stdout
    refused = run_module("eval", "baselines", "--config", str(REPO_ROOT / "configs/pretrain/simclr_digits.yaml"),
                         "optim.lrr=1")
    assert refused.returncode == 2 and "did you mean 'optim.lr'" in refused.stderr


@pytest.mark.parametrize("protocol", ["knn", "linear"])
def test_validation_data_with_other_classes_is_refused_not_matched_by_index(digits, tmp_path, capsys, protocol):
    """k-NN and the linear probe compare label indices: a validation set of other classes used to be scored (26-40%
    on the digits against a relabelled copy) with exit status 0."""
    other = tmp_path / "other.beton"
    shutil.copy(digits / "val.beton", other)
    other.with_suffix(".classes.json").write_text(json.dumps([f"class_{i}" for i in range(10)]))
    write_export(tmp_path / "backbone.pth", RESNET18_SMALL.state_dict(), train=digits / "train.beton", val=other)
    assert main([protocol, "--run", str(tmp_path), "--image-size", "16"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "different classes" in error and str(other) in error
    assert not (tmp_path / "eval").exists()


def test_finite_weights_giving_non_finite_features_are_refused_not_scored_at_chance(digits, tmp_path, capsys):
    """A run at a huge lr can end with finite weights whose eval-mode BatchNorm gives NaN features; k-NN used to
    report chance with exit status 0."""
    broken = {name: value.clone() for name, value in RESNET18_SMALL.state_dict().items()}
    broken["layer2.0.bn1.running_var"].fill_(-1.0)                # sqrt of a negative variance: NaN in eval mode
    write_export(tmp_path / "backbone.pth", broken, train=digits / "train.beton", val=digits / "val.beton")
    assert main(["knn", "--run", str(tmp_path), "--image-size", "16"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "NaN or inf features for 1437 of 1437 images" in error


def test_a_readme_or_a_checkpoint_shard_given_as_an_export_is_named_as_such(tmp_path, capsys):
    readme = Path(__file__).resolve().parents[1] / "README.md"
    torch.save({"module": argparse.Namespace(lr=0.1)}, tmp_path / "mp_rank_00_model_states.pt")
    for path in (readme, tmp_path / "mp_rank_00_model_states.pt"):
        assert main(["knn", "--checkpoint", str(path)]) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and "is not a backbone export" in error and "exports/" in error
        assert "weights_only=False" not in error                  # torch's advice to unpickle an untrusted file
    assert "holds Python objects" in error


def test_output_paths_of_the_wrong_kind_are_refused_in_one_line(tmp_path, capsys):
    """`eval baselines --out-dir FILE` and `eval plot --out DIRECTORY` used to end in tracebacks (or a PNG written
    beside the directory)."""
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    assert main(["baselines", "--config", str(Path(__file__).parents[1] / "configs/pretrain/simclr_digits.yaml"),
                 "--out-dir", str(afile)]) == 2
    assert "is a file; pass a folder" in capsys.readouterr().err
    assert main(["plot", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "must be a .png file" in capsys.readouterr().err
    assert afile.read_text() == "mine" and not (tmp_path.parent / f"{tmp_path.name}.png").exists()


def test_an_image_size_too_large_to_decode_is_named_not_the_stored_images(digits, tmp_path, capsys):
    """--image-size 100000 used to blame the .beton's images (32 px) and advise rewriting it with --max-side."""
    write_export(tmp_path / "backbone.pth", RESNET18_SMALL.state_dict(), train=digits / "train.beton",
                 val=digits / "val.beton")
    assert main(["knn", "--run", str(tmp_path), "--image-size", "100000", "--no-cache"]) == 2
    error = capsys.readouterr().err.strip()
    assert "images of 100000 x 100000 px in batches of 256" in error and "--image-size" in error
    assert "--max-side" not in error and len(error.splitlines()) == 1
