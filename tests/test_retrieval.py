"""Retrieval metrics (Recall@k, precision@1, R-precision, MAP@R, R-mAP) and NMI against brute-force
computations on planted examples (ties, a class of one image), R-mAP vs MAP@R on a hand-made case of paper
000's appendix C, `python -m eval retrieval` end to end on the digits' DML split, and the embedding head of the
metric-learning methods: exported beside the backbone, and what retrieval ranks by (or the backbone, on request)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from eval.retrieval import clustering_nmi, retrieval_metrics, retrieval_per_query
from tests.eval_helpers import RESNET18_SMALL, read_scalars, write_export


def brute_force_per_query(features, labels, ks=(1, 2, 4, 8)):
    """Rank by (-cosine similarity, index), then each metric's definition, one query at a time."""
    x = [np.asarray(f, dtype=np.float64) / np.linalg.norm(f) for f in features.tolist()]
    labels = labels.tolist()
    results = []
    for q in range(len(x)):
        database = sorted((j for j in range(len(x)) if j != q), key=lambda j: (-float(x[q] @ x[j]), j))
        rel = [1.0 if labels[j] == labels[q] else 0.0 for j in database]
        r = sum(rel)
        if r == 0:
            results.append(None)
            continue
        r = int(r)
        precision = [sum(rel[:k]) / k for k in range(1, len(rel) + 1)]
        summed = sum(precision[k] * rel[k] for k in range(r))
        hits = sum(rel[:r])
        row = {f"recall@{k}": float(any(rel[:k])) for k in ks}
        row.update({"precision@1": rel[0], "r_precision": hits / r, "map@r": summed / r,
                    "r_map": summed / hits if hits else 0.0})
        results.append(row)
    return results


def brute_force_means(rows):
    counted = [row for row in rows if row is not None]
    return {name: sum(row[name] for row in counted) / len(counted) for name in counted[0]}


def planted_with_ties():
    """Five directions, several images on each (equal features: ties), one class with a single image."""
    directions = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0], [0.6, 0.8, 0], [1.0, 1.0, 1.0]])
    which = torch.tensor([0, 0, 1, 3, 2, 0, 1, 4, 3, 3, 2, 1, 0, 4])
    labels = torch.tensor([0, 0, 1, 0, 2, 1, 1, 3, 0, 1, 2, 2, 3, 4])          # class 4: one image
    return directions[which], labels


@pytest.mark.parametrize("chunk_size", [1, 5, 1024])
def test_metrics_match_brute_force_with_ties_and_a_class_of_one_image(chunk_size):
    features, labels = planted_with_ties()
    rows = brute_force_per_query(features, labels)
    assert rows[13] is None                                             # the class of one image: no query
    metrics = retrieval_metrics(features, labels, chunk_size=chunk_size)
    assert metrics["queries"] == 13 and metrics["no_relevant"] == 1
    for name, value in brute_force_means(rows).items():
        assert metrics[name] == pytest.approx(value, abs=1e-12), name
    per_query = retrieval_per_query(features, labels, chunk_size=chunk_size)
    assert math.isnan(per_query["map@r"][13])
    for q, row in enumerate(rows[:13]):
        for name, value in row.items():
            assert per_query[name][q].item() == pytest.approx(value, abs=1e-12), (q, name)


def test_metrics_match_brute_force_on_random_features_across_chunks():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 6, (70,), generator=g)
    features = torch.randn(70, 8, generator=g) + 1.5 * torch.nn.functional.one_hot(labels, 8).float()
    expected = brute_force_means(brute_force_per_query(features, labels, ks=(1, 3, 10)))
    metrics = retrieval_metrics(features, labels, ks=(1, 3, 10), chunk_size=16)
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, abs=1e-9), name
    assert 0 < metrics["map@r"] < metrics["r_map"] < 1 and metrics["recall@1"] == metrics["precision@1"]


def test_r_map_and_map_at_r_on_the_hand_made_case_of_appendix_c():
    """Paper 000, appendix C: R-mAP averages precision over the relevant images AMONG the R first, MAP@R over
    R. The query at angle 0 sees A B A B A (angles 10-50 degrees), R = 3: the relevant images of the first 3
    are at ranks 1 and 3, sum P(k) rel(k) = 1 + 2/3."""
    angles = torch.tensor([0.0, 10, 20, 30, 40, 50]) * math.pi / 180
    features = torch.stack([angles.cos(), angles.sin()], dim=1)
    labels = torch.tensor([0, 0, 1, 0, 1, 0])                           # A A B A B A
    per_query = retrieval_per_query(features, labels)
    assert per_query["map@r"][0].item() == pytest.approx((1 + 2 / 3) / 3)        # 5/9
    assert per_query["r_map"][0].item() == pytest.approx((1 + 2 / 3) / 2)        # 5/6
    assert per_query["r_precision"][0].item() == pytest.approx(2 / 3)
    assert per_query["recall@1"][0].item() == 1.0 and per_query["precision@1"][0].item() == 1.0
    assert (per_query["r_map"] >= per_query["map@r"] - 1e-12).all()                # never below, by definition


def test_nmi_of_planted_clusters_and_against_the_contingency_table():
    centres = torch.eye(4)
    # 3 classes on 3 well-separated locations; class 0 spread over locations 0 and 1 (k-means finds the
    # 3 locations: the clustering is known and so is its NMI).
    location = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2])
    labels = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2])
    noise = 0.01 * torch.randn(12, 4, generator=torch.Generator().manual_seed(1))
    features = centres[location] + noise
    table = np.zeros((3, 3))
    np.add.at(table, (labels.numpy(), location.numpy()), 1)
    p = table / table.sum()
    pc, pk = p.sum(1), p.sum(0)
    mutual = sum(p[i, j] * math.log(p[i, j] / (pc[i] * pk[j])) for i in range(3) for j in range(3) if p[i, j] > 0)
    entropy = lambda q: -sum(v * math.log(v) for v in q if v > 0)        # noqa: E731
    expected = mutual / math.sqrt(entropy(pc) * entropy(pk))              # I / sqrt(H H), paper 001
    assert clustering_nmi(features, labels) == pytest.approx(expected, rel=1e-9)
    assert expected < 0.99
    assert clustering_nmi(centres[labels] + noise, labels + 7) == pytest.approx(1.0)   # label names do not matter


def test_bad_inputs_are_refused_by_name():
    with pytest.raises(ValueError, match="at least 2 images"):
        retrieval_metrics(torch.randn(1, 3), torch.tensor([0]))
    with pytest.raises(ValueError, match="one label per row"):
        retrieval_metrics(torch.randn(4, 3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"ks=\(0,\) must be positive"):
        retrieval_metrics(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]), ks=(0,))


def write_small_set(path: Path, labels: list[int], seed: int) -> Path:
    """A small .beton of 16 px images whose class is a bright square at a class-specific place, with the
    class names of all 10 classes next to it (as the digits' DML split has)."""
    from pretrain.data.writer import ArrayImageSet, classes_path, write_beton

    rng = np.random.default_rng(seed)
    images = rng.integers(0, 60, size=(len(labels), 16, 16, 3), dtype=np.uint8)
    for image, label in zip(images, labels):
        row, col = divmod(label, 4)
        image[4 * row:4 * row + 4, 4 * col:4 * col + 4] = 250
    write_beton(path, ArrayImageSet(lambda i: images[i], list(labels), None), workers=1)
    classes_path(path).write_text(json.dumps([str(c) for c in range(10)]))
    return path


@pytest.mark.slow
def test_cli_retrieval_with_split_classes_writes_json_and_tensorboard(tmp_path, capsys, monkeypatch):
    """`python -m eval retrieval --split-classes` on a random-init ResNet-18: only the images of classes 5-9
    of the validation data are evaluated, and the JSON and TensorBoard hold their metrics, recomputed here
    from the cached features."""
    from eval.__main__ import main
    from eval.inputs import EvaluationInputs

    train = write_small_set(tmp_path / "train.beton", [c % 5 for c in range(20)], seed=0)
    val = write_small_set(tmp_path / "val.beton", [c % 10 for c in range(40)], seed=1)
    run = tmp_path / "run"
    write_export(run / "backbone.pth", RESNET18_SMALL.state_dict(), train=train, val=val, step=40,
                 eval_image_size=16, eval_crop_fraction=1.0)
    argv = ["retrieval", "--run", str(run), "--device", "cpu", "--image-size", "16", "--crop-fraction", "1.0"]
    assert main([*argv, "--split-classes", "--chunk-size", "7"]) == 0
    result = json.loads((run / "eval" / "retrieval_step0000040.json").read_text())
    features = torch.load(run / "eval" / "features_step0000040.pt", weights_only=True)["features"]
    unseen = features["val_labels"] >= 5
    assert result["classes"] == [5, 6, 7, 8, 9] and result["num_images"] == 20 and result["split_classes"]
    expected = retrieval_metrics(features["val_features"][unseen], features["val_labels"][unseen])
    for name in ("recall@1", "recall@8", "precision@1", "r_precision", "map@r", "r_map"):
        assert result[name] == pytest.approx(expected[name]), name
    assert result["top1"] == result["recall@1"] and 0 <= result["nmi"] <= 1
    scalars = read_scalars(run / "tb")
    assert scalars["eval/retrieval_recall_at_1"] == [(40, pytest.approx(result["recall@1"]))]
    assert scalars["eval/retrieval_map_at_r"] == [(40, pytest.approx(result["map@r"]))]
    assert scalars["eval/retrieval_nmi"] == [(40, pytest.approx(result["nmi"]))]
    assert "r_map" in capsys.readouterr().out
    # Without --split-classes every class is evaluated (from the cached features).
    assert main(argv) == 0
    assert json.loads((run / "eval" / "retrieval_step0000040.json").read_text())["num_images"] == 40
    # Data of the training classes only: --split-classes leaves nothing, which is refused in one line.
    first_half = {**features, "val_labels": features["val_labels"] % 5}
    monkeypatch.setattr(EvaluationInputs, "features", lambda self: first_half)
    assert main([*argv, "--split-classes"]) == 2
    assert "keeps the images of classes 5-9" in capsys.readouterr().err
    # Data of one class: the ranking metrics are scored and NMI, undefined, is skipped with a note (it used to
    # fail in scikit-learn).
    one_class = {**features, "val_labels": torch.zeros_like(features["val_labels"])}
    monkeypatch.setattr(EvaluationInputs, "features", lambda self: one_class)
    assert main(argv) == 0
    result = json.loads((run / "eval" / "retrieval_step0000040.json").read_text())
    assert result["nmi"] is None and result["nmi_skipped"] == "one class: NMI is undefined" and result["r_map"] == 1.0
    assert "nmi          skipped (one class" in capsys.readouterr().out


# ============ the embedding the metric-learning methods train: exported, and what retrieval ranks by ============

@pytest.fixture
def group_of_one():
    """A process group of one in this process (export_backbone gathers and writes on rank 0), released after."""
    from pretrain.runtime.distributed import init_distributed, release_distributed

    init_distributed("cpu")
    yield
    release_distributed()


@pytest.mark.parametrize("config, exports_head, head", [("weighted_contrastive_digits.yaml", True, []),
                                                        ("smoco_digits.yaml", True, []),
                                                        ("contrastive_balance_digits.yaml", True, []),
                                                        ("contrastive_balance_digits.yaml", True,
                                                         ["model.proj_hidden_bn=false"]),
                                                        ("simclr_digits.yaml", False, [])])
def test_export_carries_the_embedding_head_beside_an_unchanged_backbone(group_of_one, tmp_path, config, exports_head,
                                                                        head):
    """The metric-learning methods' backbone.pth holds their projector as embedding_head, which rebuilds to the same
    function (SupContrast's Linear-ReLU-Linear head too: the export records hidden_bn); `state_dict` is still the
    backbone alone, so every reader of the backbone (load_backbone_export: k-NN, linear, fine-tuning, detection; the
    Detectron2 converter reads state_dict) gets it unchanged."""
    from eval.features import load_backbone_export
    from pretrain.config import load_config
    from pretrain.methods import build_method
    from pretrain.export import export_backbone

    cfg = load_config(f"configs/pretrain/{config}", ["model.proj_hidden_dim=32", "model.proj_out_dim=16",
                                                     "model.proj_layers=2", f"run_dir={tmp_path}", *head])
    torch.manual_seed(0)
    method = build_method(cfg)
    for module in method.modules():                       # BatchNorm statistics that eval mode must use
        if isinstance(module, torch.nn.BatchNorm1d):
            module.running_mean.normal_()
            module.running_var.uniform_(0.5, 2.0)
    export_backbone(method, tmp_path, cfg, epoch=1, step=5)
    raw = torch.load(tmp_path / "backbone.pth", weights_only=True)
    backbone_state = method.backbone.state_dict()
    assert raw["state_dict"].keys() == backbone_state.keys()
    assert all(torch.equal(raw["state_dict"][k], backbone_state[k]) for k in backbone_state)
    export = load_backbone_export(tmp_path / "backbone.pth")
    x = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    method.eval()
    with torch.no_grad():
        features = method.backbone(x)
        torch.testing.assert_close(export.backbone(x), features)
    if not exports_head:
        assert "embedding_head" not in raw and export.embedding_head is None
        return
    assert {k: raw["embedding_head"][k] for k in ("in_dim", "hidden_dim", "out_dim", "num_layers")} == {
        "in_dim": 512, "hidden_dim": 32, "out_dim": 16, "num_layers": 2}
    assert raw["embedding_head"]["hidden_bn"] is ("model.proj_hidden_bn=false" not in head)
    with torch.no_grad():
        torch.testing.assert_close(export.embedding_head(features), method.projector(features))


def planted_export_and_features(tmp_path, monkeypatch, with_head: bool):
    """A run whose export has (or lacks) a 2-layer embedding head with BatchNorm statistics, and planted backbone
    features of 30 validation images (EvaluationInputs.features is what the cache or the extraction returns)."""
    from eval.inputs import EvaluationInputs
    from pretrain.models import mlp

    g = torch.Generator().manual_seed(4)
    head = mlp(512, 32, 8, 2)
    head[1].running_mean.normal_(generator=g)
    head[1].running_var.uniform_(0.5, 2.0, generator=g)
    entry = {"in_dim": 512, "hidden_dim": 32, "out_dim": 8, "num_layers": 2, "state_dict": head.state_dict()}
    run = tmp_path / "run"
    write_export(run / "backbone.pth", RESNET18_SMALL.state_dict(), train=tmp_path, val=tmp_path, step=40,
                 embedding_head=entry if with_head else None, eval_image_size=16)
    labels = torch.arange(30) % 4
    backbone = torch.randn(30, 512, generator=g) + 0.5 * torch.randn(4, 512, generator=g)[labels]
    features = {"train_features": backbone, "train_labels": labels, "val_features": backbone, "val_labels": labels}
    monkeypatch.setattr(EvaluationInputs, "features", lambda self: features)
    return run, head.eval(), backbone, labels


def assert_result_is_brute_force_on(result, features, labels):
    expected = brute_force_means(brute_force_per_query(features, labels))
    for name, value in expected.items():
        assert result[name] == pytest.approx(value, abs=1e-9), name
    assert result["nmi"] == pytest.approx(clustering_nmi(features, labels))


def test_retrieval_ranks_by_the_embedding_by_default_and_by_the_backbone_when_asked(tmp_path, monkeypatch):
    from eval.__main__ import main

    run, head, backbone, labels = planted_export_and_features(tmp_path, monkeypatch, with_head=True)
    argv = ["retrieval", "--run", str(run), "--device", "cpu", "--image-size", "16"]
    assert main(argv) == 0
    result = json.loads((run / "eval" / "retrieval_step0000040.json").read_text())
    assert result["features"] == "embedding" and result["dimensions"] == 8
    with torch.no_grad():
        embedding = head(backbone)                                # head(backbone(x)), BatchNorm in eval mode
    assert_result_is_brute_force_on(result, embedding, labels)
    assert read_scalars(run / "tb")["eval/retrieval_map_at_r"] == [(40, pytest.approx(result["map@r"]))]
    # --features backbone: the backbone's features, next to the embedding's result (which stays)
    assert main([*argv, "--features", "backbone"]) == 0
    on_backbone = json.loads((run / "eval" / "retrieval_backbone_step0000040.json").read_text())
    assert on_backbone["features"] == "backbone" and on_backbone["dimensions"] == 512
    assert on_backbone["protocol"] == "retrieval_backbone"
    assert_result_is_brute_force_on(on_backbone, backbone, labels)
    assert json.loads((run / "eval" / "retrieval_step0000040.json").read_text()) == result


def test_retrieval_of_an_export_without_a_head_is_on_the_backbone_and_refuses_the_embedding(tmp_path, monkeypatch,
                                                                                           capsys):
    from eval.__main__ import main

    run, _, backbone, labels = planted_export_and_features(tmp_path, monkeypatch, with_head=False)
    argv = ["retrieval", "--run", str(run), "--device", "cpu", "--image-size", "16"]
    assert main(argv) == 0                                           # as before heads were exported
    result = json.loads((run / "eval" / "retrieval_step0000040.json").read_text())
    assert result["features"] == "backbone" and result["protocol"] == "retrieval"
    assert_result_is_brute_force_on(result, backbone, labels)
    assert main([*argv, "--features", "embedding"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert str(run / "backbone.pth") in error and "no embedding head" in error and "--features backbone" in error


def test_an_embedding_head_that_does_not_fit_its_shape_is_refused_in_one_line(tmp_path, capsys):
    from eval.__main__ import main
    from pretrain.models import mlp

    two_layers = mlp(512, 32, 8, 2).state_dict()
    entry = {"in_dim": 512, "hidden_dim": 32, "out_dim": 8, "num_layers": 1, "state_dict": two_layers}
    write_export(tmp_path / "backbone.pth", RESNET18_SMALL.state_dict(), train=tmp_path, val=tmp_path,
                 embedding_head=entry)
    assert main(["retrieval", "--run", str(tmp_path), "--device", "cpu"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "embedding_head weights" in error and "--features backbone" in error
