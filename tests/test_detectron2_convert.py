"""The Detectron2 converter (`python -m transfer detectron2 convert`) against Detectron2's real R50-C4 names.

CI cannot import Detectron2, so its names come from tests/data/detectron2_r50_c4_state_dict.txt: the state_dict of
the R50-C4 Faster R-CNN (backbone and res5 box head) that the real Detectron2 built from
configs/transfer/detectron2/voc_R_50_C4_24k.yaml (the file's header names the build and the command). The
tests load the converted pickle the way Detectron2's DetectionCheckpointer matches a `matching_heuristics`
checkpoint: each model entry takes the checkpoint name that is its longest dot-separated suffix.
"""
from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrain.models import create_backbone
from transfer.__main__ import main
from transfer.detectron2.weights import Detectron2InputError, convert_export

D2_STATE_DICT = Path(__file__).parent / "data" / "detectron2_r50_c4_state_dict.txt"
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def detectron2_r50_c4_entries() -> dict[str, tuple[int, ...]]:
    entries = {}
    for line in D2_STATE_DICT.read_text().splitlines():
        if line and not line.startswith("#"):
            name, *shape = line.split()
            entries[name] = tuple(int(d) for d in shape)
    return entries


def write_export(path: Path, arch: str, stem: str = "imagenet", seed: int = 0,
                 mean: list[float] = IMAGENET_MEAN, std: list[float] = IMAGENET_STD) -> Path:
    """A backbone export as `pretrain.export.export_backbone` writes it, every tensor set to distinct random
    values (BatchNorm's default ones and zeros would hide a swapped name)."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for index, (name, tensor) in enumerate(create_backbone(arch, stem, image_size=32).state_dict().items()):
        if tensor.is_floating_point():
            values = torch.randn(tensor.shape, generator=generator)
            state[name] = values.abs() + 0.1 if name.endswith("running_var") else values
        else:
            state[name] = torch.tensor(1000 + index, dtype=tensor.dtype)     # num_batches_tracked
    config = {"data": {"mean": mean, "std": std, "views": [{"size": 32}]}, "model": {"arch": arch, "stem": stem}}
    torch.save({"arch": arch, "stem": stem, "state_dict": state, "config": config, "epoch": 3, "step": 42}, path)
    return path


@pytest.fixture(scope="module")
def resnet50_export(tmp_path_factory) -> Path:
    return write_export(tmp_path_factory.mktemp("r50") / "backbone.pth", "resnet50",
                        mean=[0.25, 0.3, 0.35], std=[0.2, 0.22, 0.24])


def renamed_like_moco(name: str) -> str:
    """The rename written a second, independent way (string replacements, as MoCo's converter describes it)."""
    if not name.startswith("layer"):
        name = "stem." + name
    for stage in (1, 2, 3, 4):
        name = name.replace(f"layer{stage}.", f"res{stage + 1}.")
    for k in (1, 2, 3):
        name = name.replace(f"bn{k}.", f"conv{k}.norm.")
    return name.replace("downsample.0.", "shortcut.").replace("downsample.1.", "shortcut.norm.")


def checkpointer_matches(model_names: list[str], checkpoint_names: list[str]) -> dict[str, str]:
    """Detectron2's `align_and_update_state_dicts` rule: model name -> the longest checkpoint name that equals it
    or is a suffix after a dot. Raises if one checkpoint name would feed two model names (Detectron2 does)."""
    matches: dict[str, str] = {}
    for model_name in model_names:
        candidates = [c for c in checkpoint_names if model_name == c or model_name.endswith("." + c)]
        if candidates:
            matches[model_name] = max(candidates, key=len)
    used = list(matches.values())
    assert len(used) == len(set(used)), "a checkpoint name matches two model names"
    return matches


def load_like_detectron2(path: Path) -> dict:
    with open(path, "rb") as file:
        return pickle.load(file, encoding="latin1")


def test_every_export_tensor_lands_on_its_detectron2_entry_with_equal_shape_and_value(resnet50_export, tmp_path):
    out = tmp_path / "r50.pkl"
    assert main(["detectron2", "convert", "--run", str(resnet50_export.parent), "--out", str(out)]) == 0
    converted = load_like_detectron2(out)
    assert converted["__author__"] == "hardview" and converted["matching_heuristics"] is True
    export = torch.load(resnet50_export, weights_only=True)["state_dict"]
    weights = converted["model"]
    assert len(weights) == len(export) == 318

    entries = detectron2_r50_c4_entries()
    matches = checkpointer_matches(list(entries), list(weights))
    matched_by = {checkpoint_name: model_name for model_name, checkpoint_name in matches.items()}
    for name, tensor in export.items():
        checkpoint_name = renamed_like_moco(name)
        assert checkpoint_name in weights, f"{name} not converted to {checkpoint_name}"
        model_name = matched_by[checkpoint_name]       # KeyError: Detectron2 would leave it unused
        assert entries[model_name] == tuple(tensor.shape) == weights[checkpoint_name].shape
        assert np.array_equal(weights[checkpoint_name], tensor.numpy()), name
        assert weights[checkpoint_name].dtype == tensor.numpy().dtype
    # The stem and res2-res4 go to the backbone, res5 to the box head (R50-C4).
    assert matched_by["stem.conv1.weight"] == "backbone.stem.conv1.weight"
    assert matched_by["res4.5.conv3.norm.running_var"] == "backbone.res4.5.conv3.norm.running_var"
    assert matched_by["res5.0.shortcut.weight"] == "roi_heads.res5.0.shortcut.weight"


def test_nothing_the_backbone_should_provide_is_missing(resnet50_export):
    weights = convert_export(resnet50_export)["model"]
    entries = detectron2_r50_c4_entries()
    matches = checkpointer_matches(list(entries), list(weights))
    missing = sorted(set(entries) - set(matches))
    # Only MoCo's new norm after res5 starts from scratch; every backbone and res5 entry is loaded.
    assert missing == [f"roi_heads.res5.norm.{t}"
                       for t in sorted(("weight", "bias", "running_mean", "running_var", "num_batches_tracked"))]
    assert len(matches) == len(weights) == len(entries) - 5


def test_the_pickle_carries_the_exports_input_statistics(resnet50_export):
    info = convert_export(resnet50_export)["hardview"]
    assert info["input_format"] == "RGB" and info["depth"] == 50 and info["stride_in_1x1"] is False
    assert info["pixel_mean"] == pytest.approx([63.75, 76.5, 89.25])           # data.mean x 255
    assert info["pixel_std"] == pytest.approx([51.0, 56.1, 61.2])              # data.std x 255
    assert (info["arch"], info["stem"], info["epoch"], info["step"]) == ("resnet50", "imagenet", 3, 42)


@pytest.mark.parametrize("arch, stem, message", [
    ("resnet18", "imagenet", "model.arch='resnet18' is built of BasicBlocks"),
    ("vit_tiny_patch16_224", "imagenet", "model.arch='vit_tiny_patch16_224' is not a ResNet"),
    ("resnet50", "small", "model.stem='small'"),
    ("resnet50", "small_stride2", "model.stem='small_stride2'"),
    ("resnet50d", "imagenet", "'conv1.0.weight' is not part of a standard ResNet-50"),
])
def test_what_detectron2_cannot_take_is_refused_in_one_line(arch, stem, message, tmp_path, capsys):
    write_export(tmp_path / "backbone.pth", arch, stem)
    assert main(["detectron2", "convert", "--run", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and error.count("\n") == 1 and message in error
    assert "pretrain with" in error or "export resnet50" in error      # says what to do
    assert not (tmp_path / "detectron2").exists()


def test_exports_with_missing_or_non_finite_weights_are_refused(resnet50_export, tmp_path):
    export = torch.load(resnet50_export, weights_only=True)
    export["state_dict"]["layer3.2.bn2.running_var"][7] = float("nan")
    torch.save(export, tmp_path / "nan.pth")
    with pytest.raises(Detectron2InputError, match=r"NaN or inf in 1 tensors \(layer3\.2\.bn2\.running_var\)"):
        convert_export(tmp_path / "nan.pth")
    del export["state_dict"]["layer4.1.conv2.weight"]
    torch.save(export, tmp_path / "missing.pth")
    with pytest.raises(Detectron2InputError, match=r"lacks 1 entries of a ResNet-50, e\.g\. 'layer4\.1\.conv2\."):
        convert_export(tmp_path / "missing.pth")


def test_train_without_detectron2_exits_2_with_the_install_steps(resnet50_export, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "detectron2", None)       # import detectron2 -> ImportError, as in CI
    code = main(["detectron2", "train", "--config", "configs/transfer/detectron2/voc_R_50_C4_24k.yaml",
                 "--weights", str(tmp_path / "r50.pkl"), "SOLVER.MAX_ITER", "10"])
    error = capsys.readouterr().err
    assert code == 2 and error.count("\n") == 1
    assert "cannot import Detectron2" in error
    for step in ("git clone https://github.com/facebookresearch/detectron2", "pip install wheel setuptools",
                 "pip --isolated install --no-build-isolation .", "from detectron2 import _C"):
        assert step in error
