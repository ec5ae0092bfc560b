"""The Detectron2 weight converter: a backbone export (RUN_DIR/backbone.pth) -> the .pkl Detectron2 loads.

`python -m transfer detectron2 convert` (transfer/detectron2/__init__.py) runs it and `... train`
(transfer/detectron2/train.py) reads its pickle back; it needs no Detectron2 and imports neither of them.

The converter maps the export's ResNet (timm / torchvision names) to Detectron2's ResNet names:

    export (timm ResNet)                    Detectron2 ResNet
    conv1.weight                            stem.conv1.weight
    bn1.{weight,bias,running_*,...}         stem.conv1.norm.{...}
    layer1 .. layer4                        res2 .. res5
    layerN.M.convK.weight                   resN+1.M.convK.weight
    layerN.M.bnK.{...}                      resN+1.M.convK.norm.{...}
    layerN.M.downsample.0.weight            resN+1.M.shortcut.weight
    layerN.M.downsample.1.{...}             resN+1.M.shortcut.norm.{...}

The pickle is `{"model": {name: numpy array}, "__author__": "hardview", "matching_heuristics": True,
"hardview": {...}}`. The names carry no `backbone.` / `roi_heads.` prefix: with `matching_heuristics`
Detectron2's `DetectionCheckpointer` gives each model parameter the checkpoint entry whose name is its longest
suffix, which puts the stem and res2-res4 into `backbone.*` and res5 into `roi_heads.res5.*` (in R50-C4 the last
stage is the box head). BatchNorm's `num_batches_tracked` counters are kept: the configs' BatchNorm layers have
them, so every backbone entry loads (a FrozenBN config, Detectron2's default, reports them as unused).

`"hardview"` holds what Detectron2 must be told about the input the backbone was trained on; `train` applies it
to the config (before the command line's KEY VALUE pairs, which win): `input_format` "RGB" (INPUT.FORMAT: the
pretraining loaders decode to RGB), `pixel_mean` / `pixel_std` (MODEL.PIXEL_MEAN / PIXEL_STD: the export's
`data.mean` / `data.std`, RGB in [0, 1], times 255, Detectron2's scale), `depth` (MODEL.RESNETS.DEPTH) and
`stride_in_1x1` False (MODEL.RESNETS.STRIDE_IN_1X1: timm puts a block's stride in its 3x3 convolution), with the
source export, its epoch and step.

What Detectron2's R50-C4 cannot take is refused with a one-line message naming the value and what to do:
non-ResNet architectures (ViT), ResNets of BasicBlocks (ResNet-18 / 34), the `small` / `small_stride2` stems of
`pretrain.models`, layouts other than the standard ResNet-50 / 101 / 152 (ResNet-D deep stems, ResNeXt, wide
ResNets), and exports with missing or non-finite weights.
"""
from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eval.features import EvaluationInputError, load_backbone_export

# Bottleneck blocks per stage (res2 .. res5) of the depths Detectron2's ResNet builds (MODEL.RESNETS.DEPTH).
BLOCKS_PER_STAGE = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}
AUTHOR = "hardview"

_BATCH_NORM_TENSORS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
_STEM_CONV = re.compile(r"conv1\.weight")
_STEM_NORM = re.compile(r"bn1\.(\w+)")
_BLOCK_CONV = re.compile(r"layer([1-4])\.(\d+)\.conv([1-3])\.weight")
_BLOCK_NORM = re.compile(r"layer([1-4])\.(\d+)\.bn([1-3])\.(\w+)")
_SHORTCUT_CONV = re.compile(r"layer([1-4])\.(\d+)\.downsample\.0\.weight")
_SHORTCUT_NORM = re.compile(r"layer([1-4])\.(\d+)\.downsample\.1\.(\w+)")


class Detectron2InputError(Exception):
    """A user-facing problem with the inputs of `convert` or `train`; the message names the value and the fix.

    `python -m transfer detectron2` prints it without a traceback and exits with status 2.
    """


# ============ the converter ============


def detectron2_name(name: str) -> str:
    """The Detectron2 ResNet name of a timm / torchvision ResNet state_dict entry (table in the module docstring).

    Raises `Detectron2InputError` for a name outside the standard ResNet layout.
    """
    if _STEM_CONV.fullmatch(name):
        return "stem.conv1.weight"
    if match := _STEM_NORM.fullmatch(name):
        return f"stem.conv1.norm.{match[1]}"
    if match := _BLOCK_CONV.fullmatch(name):
        return f"res{int(match[1]) + 1}.{match[2]}.conv{match[3]}.weight"
    if match := _BLOCK_NORM.fullmatch(name):
        return f"res{int(match[1]) + 1}.{match[2]}.conv{match[3]}.norm.{match[4]}"
    if match := _SHORTCUT_CONV.fullmatch(name):
        return f"res{int(match[1]) + 1}.{match[2]}.shortcut.weight"
    if match := _SHORTCUT_NORM.fullmatch(name):
        return f"res{int(match[1]) + 1}.{match[2]}.shortcut.norm.{match[3]}"
    raise Detectron2InputError(
        f"backbone weight {name!r} has no place in Detectron2's ResNet (stem, res2-res5, shortcut, norm): export a "
        "standard ResNet (model.arch=resnet50, resnet101 or resnet152 with model.stem=imagenet)")


def standard_resnet_shapes(depth: int) -> dict[str, tuple[int, ...]]:
    """Every state_dict entry of a standard Bottleneck ResNet of `depth` (torchvision / timm names), with its shape.

    Stage s (1-4) has width w = 64 * 2^(s-1) and output 4w; its first block reaches 4w through a 1x1 shortcut.
    This is the layout Detectron2 builds for MODEL.RESNETS.DEPTH with its defaults (NUM_GROUPS 1,
    WIDTH_PER_GROUP 64, STEM_OUT_CHANNELS 64, RES2_OUT_CHANNELS 256).
    """
    def norm(prefix: str, channels: int) -> dict[str, tuple[int, ...]]:
        return {f"{prefix}.{t}": (() if t == "num_batches_tracked" else (channels,)) for t in _BATCH_NORM_TENSORS}

    shapes: dict[str, tuple[int, ...]] = {"conv1.weight": (64, 3, 7, 7), **norm("bn1", 64)}
    in_channels = 64
    for stage, num_blocks in enumerate(BLOCKS_PER_STAGE[depth], start=1):
        width = 64 * 2 ** (stage - 1)
        out_channels = 4 * width
        for block in range(num_blocks):
            prefix = f"layer{stage}.{block}"
            convs = {1: (width, in_channels, 1, 1), 2: (width, width, 3, 3), 3: (out_channels, width, 1, 1)}
            for k, shape in convs.items():
                shapes[f"{prefix}.conv{k}.weight"] = shape
                shapes.update(norm(f"{prefix}.bn{k}", shape[0]))
            if block == 0:
                shapes[f"{prefix}.downsample.0.weight"] = (out_channels, in_channels, 1, 1)
                shapes.update(norm(f"{prefix}.downsample.1", out_channels))
            in_channels = out_channels
    return shapes


def resnet_depth(arch: str, stem: str, state_dict: dict[str, torch.Tensor]) -> int:
    """The Detectron2 depth (50, 101, 152) of an exported ResNet, after refusing what its ResNet cannot take."""
    if arch.startswith("vit") or not any(name.startswith("layer1.") for name in state_dict):
        raise Detectron2InputError(
            f"model.arch={arch!r} is not a ResNet: Detectron2's R50-C4 detector takes ResNet-50, -101 or -152 "
            "exports; pretrain with model.arch=resnet50 model.stem=imagenet (ViT exports would need Detectron2's "
            "ViTDet, which this converter does not write)")
    if "layer1.0.conv3.weight" not in state_dict:
        raise Detectron2InputError(
            f"model.arch={arch!r} is built of BasicBlocks (ResNet-18 / 34): MoCo's detection protocol and this "
            "converter take Bottleneck ResNets of depth 50 or more; pretrain with model.arch=resnet50 (or "
            "resnet101, resnet152) and model.stem=imagenet")
    if stem != "imagenet":
        raise Detectron2InputError(
            f"model.stem={stem!r}: Detectron2's ResNet stem is the 7x7 stride-2 convolution with max-pool that "
            "model.stem=imagenet keeps, and a 3x3 small-image stem does not fit it; pretrain with model.stem=imagenet")
    blocks = tuple(len({name.split(".")[1] for name in state_dict if name.startswith(f"layer{stage}.")})
                   for stage in range(1, 5))
    depth = next((d for d, counts in BLOCKS_PER_STAGE.items() if counts == blocks), None)
    if depth is None:
        raise Detectron2InputError(
            f"model.arch={arch!r} has {blocks} blocks per stage; Detectron2's ResNet builds "
            f"{', '.join(f'{counts} (depth {d})' for d, counts in BLOCKS_PER_STAGE.items())}: "
            "export resnet50, resnet101 or resnet152")
    expected = standard_resnet_shapes(depth)
    for name, tensor in state_dict.items():
        if name not in expected:
            raise Detectron2InputError(
                f"model.arch={arch!r}: {name!r} is not part of a standard ResNet-{depth} (ResNet-D deep stems, "
                "ResNeXt and wide ResNets are not what these Detectron2 configs build); export resnet50, resnet101 "
                "or resnet152")
        if tuple(tensor.shape) != expected[name]:
            raise Detectron2InputError(
                f"model.arch={arch!r}: {name} has shape {tuple(tensor.shape)} where a standard ResNet-{depth} has "
                f"{expected[name]} (ResNeXt and wide ResNets need other Detectron2 settings); export resnet50, "
                "resnet101 or resnet152")
    missing = [name for name in expected if name not in state_dict]
    if missing:
        raise Detectron2InputError(
            f"the export lacks {len(missing)} entries of a ResNet-{depth}, e.g. {missing[0]!r}: convert the whole "
            "backbone that `python -m pretrain` exported (RUN_DIR/backbone.pth)")
    return depth


def pixel_statistics(config: dict[str, Any]) -> tuple[list[float], list[float]]:
    """The export's `data.mean` / `data.std` (RGB in [0, 1]) in Detectron2's 0-255 scale (PIXEL_MEAN / STD)."""
    data = config.get("data") or {}
    mean, std = data.get("mean"), data.get("std")
    if (not isinstance(mean, (list, tuple)) or not isinstance(std, (list, tuple)) or len(mean) != 3
            or len(std) != 3 or not all(np.isfinite(float(v)) for v in [*mean, *std]) or min(std) <= 0):
        raise Detectron2InputError(
            f"the export's config has data.mean={mean}, data.std={std}: Detectron2 needs the 3 RGB values in [0, 1] "
            "(std > 0) the backbone was pretrained with; convert the backbone.pth that `python -m pretrain` wrote")
    return [255.0 * float(v) for v in mean], [255.0 * float(v) for v in std]


def convert_export(export_path: str | Path) -> dict[str, Any]:
    """Read `backbone.pth` and return Detectron2's weight dict (the pickle's content; see the module docstring).

    Raises `Detectron2InputError` for a file that is not an export, missing, reshaped or non-finite weights,
    and a backbone that Detectron2's R50-C4 cannot take.
    """
    try:
        raw = torch.load(export_path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001  not an export: load_backbone_export below says so, with the remedy
        raw = None
    if isinstance(raw, dict) and "arch" in raw and isinstance(raw.get("state_dict"), dict):
        # What Detectron2 cannot take is refused before the backbone is rebuilt (a ViT-L takes a while).
        resnet_depth(raw["arch"], raw.get("stem") or "imagenet", raw["state_dict"])
    try:
        export = load_backbone_export(export_path)     # rebuilds the backbone: names, shapes, finiteness
    except EvaluationInputError as error:
        raise Detectron2InputError(str(error)) from None
    state_dict = export.backbone.state_dict()
    depth = resnet_depth(export.arch, export.stem, state_dict)
    pixel_mean, pixel_std = pixel_statistics(export.config)
    weights = {detectron2_name(name): tensor.detach().cpu().numpy().copy() for name, tensor in state_dict.items()}
    return {
        "model": weights,
        "__author__": AUTHOR,
        "matching_heuristics": True,
        "hardview": {
            "source": str(Path(export_path).resolve()), "arch": export.arch, "stem": export.stem,
            "epoch": export.epoch, "step": export.step, "depth": depth, "stride_in_1x1": False,
            "input_format": "RGB", "pixel_mean": pixel_mean, "pixel_std": pixel_std,
        },
    }


def write_detectron2_weights(converted: dict[str, Any], out_path: str | Path) -> Path:
    """Pickle `converted` to `out_path`, written to a temporary name and renamed (never half a file)."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    try:
        with open(tmp, "wb") as file:
            pickle.dump(converted, file, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return out_path


def read_detectron2_weights(path: str | Path) -> dict[str, Any]:
    """Load a pickle written by `convert`; refuse any other file with the remedy."""
    path = Path(path)
    try:
        with open(path, "rb") as file:
            converted = pickle.load(file, encoding="latin1")     # as Detectron2's checkpointer reads a .pkl
    except (OSError, pickle.UnpicklingError, EOFError, ValueError) as error:
        raise Detectron2InputError(
            f"--weights {path} is not readable ({type(error).__name__}: {error}); write it with "
            "`python -m transfer detectron2 convert --run RUN_DIR --out FILE.pkl`") from None
    if not isinstance(converted, dict) or "model" not in converted or "hardview" not in converted:
        raise Detectron2InputError(
            f"--weights {path} is not a pickle written by `python -m transfer detectron2 convert` (it carries no "
            "'hardview' input statistics); convert the run's backbone.pth with that command")
    return converted
