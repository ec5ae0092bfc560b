"""Detection on the digit scenes: a torchvision Faster R-CNN on the exported ResNet, scored with COCO mAP.

    python -m transfer detection --run RUN_DIR [--config FILE] [key=value ...] [--from export|random]

The detector is torchvision's Faster R-CNN in the R50-C4 layout that MoCo's detection protocol uses, built on
the pretraining run's backbone export (RUN_DIR/backbone.pth, loaded as `python -m eval` loads it):
- backbone: the ResNet's stem and layer1-layer3 (stride 8 with the small_stride2 stem, 16 with the ImageNet
  stem), one feature map, on which the RPN proposes boxes from `model.anchor_sizes` x `model.aspect_ratios`;
- box head: RoIAlign of each proposal to `model.roi_output_size` px on that map, then the ResNet's layer4 and
  global average pooling (the C4 head), then a linear classifier over the 10 digits + background and a box
  regressor.
Every weight of the export is used (layer4 lives in the box head); only the RPN and the two linear outputs
start from scratch. `--from random` builds the same detector on the same architecture at random
initialisation (seeded, as pretraining starts) and trains it with the same recipe: the baseline a transfer
table needs. Only ResNets are supported (timm `resnet*`, any stem of pretrain/models.py); a ViT or another
architecture is refused.

Data: the digit scenes of `transfer.digit_scenes` under `data.root`, written there on first use
(`data.generate=false` refuses a missing set instead). Images are read into memory once, scaled to [0, 1]
and normalised inside the detector with the export's `data.mean` / `data.std`, at their own size (no
resizing). No augmentation: a flipped digit is not a digit.

Training is a plain torch loop in one process, on the CPU or one GPU (`--device auto` takes CUDA when there
is one): SGD with momentum, linear warm-up then cosine decay of the learning rate, fixed-size batches in a
seeded random order. Evaluation runs the detector on the val scenes and scores its detections with
pycocotools' COCOeval (bbox): mAP is the COCO AP averaged over IoU thresholds 0.50:0.05:0.95 with the
101-point interpolated precision, AP50 the same at IoU 0.5 alone.

Results: RUN_DIR/eval/detection_{export|random}_stepNNNNNNN.json (NNNNNNN: the step of the export; mAP,
AP50, every COCOeval statistic, the resolved config, timings) with the detections in COCO's results format
next to it (..._detections.json), and TensorBoard scalars on RUN_DIR/tb at the export's step:
`eval/detection_map`, `eval/detection_ap50` (`--from export`) and `eval/detection_random_map`,
`eval/detection_random_ap50` (`--from random`).

Config: a YAML file with the sections below (defaults in brackets); `key=value` arguments override any key
(values are YAML: `train.epochs=2`, `model.anchor_sizes=[16,32]`). An unknown key is refused with the closest
valid one. The default file is configs/transfer/detection_digit_scenes.yaml.

    seed                        [0]    seed of the random init, the new layers and the batch order
    data.root                   [data/digit_scenes]  digit-scenes folder (train.json, val.json, train/, val/)
    data.num_train, num_val     [2000, 500]  scenes per split when the set is written
    data.image_size             [96]   scene side in px when the set is written
    data.seed                   [0]    seed of the set when it is written
    data.generate               [true] write the set when data.root holds none; false: refuse
    model.anchor_sizes          [16, 24, 32, 48]  anchor sides in px (one feature map)
    model.aspect_ratios         [0.5, 1.0, 2.0]   anchor height / width
    model.roi_output_size       [4]    RoIAlign output side on the layer3 map (layer4 halves it)
    model.norm                  [train] BatchNorm: train (batch statistics, updated running statistics,
                                       learned affine; as MoCo's SyncBN) or frozen (the export's statistics
                                       and affine, fixed: torchvision's FrozenBatchNorm2d)
    model.frozen_stages         [0]    stages whose weights stay fixed: 0 none, 1 the stem, 2 the stem and
                                       layer1, 3 also layer2, 4 also layer3 (their BatchNorm is then frozen too)
    model.rpn_batch_size_per_image [128]  anchors sampled per image for the RPN loss
    model.rpn_pre_nms_top_n_train, rpn_post_nms_top_n_train [600, 200]  proposals kept before / after NMS
    model.rpn_pre_nms_top_n_test, rpn_post_nms_top_n_test   [300, 100]
    model.box_batch_size_per_image [64] proposals sampled per image for the box-head loss (25% positive)
    model.box_score_thresh      [0.01] detections scoring less are dropped before COCOeval
    model.box_detections_per_img [20]  at most this many detections per image
    train.epochs                [4]    passes over the training scenes
    train.batch_size            [8]    scenes per iteration
    train.lr                    [0.02] peak learning rate (SGD, momentum train.momentum [0.9])
    train.weight_decay          [0.0001]
    train.warmup_iters          [50]   linear warm-up from 0.1% of the peak
    train.grad_clip             [0.0]  max global gradient norm; 0 disables clipping
    train.max_iters             [0]    stop after this many iterations (0: all epochs); the lr schedule
                                       still spans all epochs
    train.print_every           [25]   iterations between progress lines
    eval.batch_size             [32]   val scenes per forward
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from eval.features import (BackboneExport, EvaluationInputError, load_backbone_export, resolve_checkpoint_path,
                           resolve_device)
from pretrain.config import ConfigError, merge_checked, parse_overrides, read_config_file, schema_keys
from pretrain.models import StridedConv2d, create_backbone
from transfer.digit_scenes import DigitScenesError, write_digit_scenes

DEFAULT_CONFIG = "configs/transfer/detection_digit_scenes.yaml"
REPOSITORY_ROOT = Path(__file__).resolve().parents[1]


class DetectionInputError(Exception):
    """A user-facing problem with the inputs of the detection command; printed in one line, exit status 2."""


# ============ config ============


@dataclass
class DataOptions:
    root: str = "data/digit_scenes"
    num_train: int = 2000
    num_val: int = 500
    image_size: int = 96
    seed: int = 0
    generate: bool = True


@dataclass
class ModelOptions:
    anchor_sizes: list[int] = field(default_factory=lambda: [16, 24, 32, 48])
    aspect_ratios: list[float] = field(default_factory=lambda: [0.5, 1.0, 2.0])
    roi_output_size: int = 4
    norm: str = "train"
    frozen_stages: int = 0
    rpn_batch_size_per_image: int = 128
    rpn_pre_nms_top_n_train: int = 600
    rpn_post_nms_top_n_train: int = 200
    rpn_pre_nms_top_n_test: int = 300
    rpn_post_nms_top_n_test: int = 100
    box_batch_size_per_image: int = 64
    box_score_thresh: float = 0.01
    box_detections_per_img: int = 20


@dataclass
class TrainOptions:
    epochs: int = 4
    batch_size: int = 8
    lr: float = 0.02
    momentum: float = 0.9
    weight_decay: float = 1e-4
    warmup_iters: int = 50
    grad_clip: float = 0.0
    max_iters: int = 0
    print_every: int = 25


@dataclass
class EvalOptions:
    batch_size: int = 32


@dataclass
class DetectionConfig:
    seed: int = 0
    data: DataOptions = field(default_factory=DataOptions)
    model: ModelOptions = field(default_factory=ModelOptions)
    train: TrainOptions = field(default_factory=TrainOptions)
    eval: EvalOptions = field(default_factory=EvalOptions)


CONFIG_KEYS = tuple(schema_keys(DetectionConfig))
KEYS_WHERE = "the docstring of transfer/detection.py"

# (key, smallest allowed value): integers and numbers outside these ranges are refused by name.
LOWER_BOUNDS = (("data.num_train", 1), ("data.num_val", 1), ("data.image_size", 32), ("data.seed", 0),
                ("model.roi_output_size", 1), ("model.frozen_stages", 0), ("model.rpn_batch_size_per_image", 1),
                ("model.rpn_pre_nms_top_n_train", 1), ("model.rpn_post_nms_top_n_train", 1),
                ("model.rpn_pre_nms_top_n_test", 1), ("model.rpn_post_nms_top_n_test", 1),
                ("model.box_batch_size_per_image", 1), ("model.box_score_thresh", 0.0),
                ("model.box_detections_per_img", 1), ("train.epochs", 1), ("train.batch_size", 1),
                ("train.momentum", 0.0), ("train.weight_decay", 0.0), ("train.warmup_iters", 0),
                ("train.grad_clip", 0.0), ("train.max_iters", 0), ("train.print_every", 1),
                ("eval.batch_size", 1))


def load_detection_config(path: str | Path | None, overrides: list[str] = ()) -> DictConfig:
    """Schema defaults <- YAML file <- `key=value` overrides, every key and value checked (ConfigError)."""
    tree = read_config_file(path, "configs/transfer/") if path is not None else {}
    cfg = merge_checked(OmegaConf.structured(DetectionConfig), CONFIG_KEYS, tree, parse_overrides(list(overrides)),
                        KEYS_WHERE)
    for key, bound in LOWER_BOUNDS:
        value = OmegaConf.select(cfg, key)
        if not math.isfinite(value) or value < bound:
            raise ConfigError(f"{key}={value} must be a finite number >= {bound}")
    if not cfg.train.lr > 0 or not math.isfinite(cfg.train.lr):
        raise ConfigError(f"train.lr={cfg.train.lr} must be a finite number > 0")
    if cfg.model.norm not in ("train", "frozen"):
        raise ConfigError(f"model.norm={cfg.model.norm!r} is not one of ('train', 'frozen')")
    if cfg.model.frozen_stages > 4:
        raise ConfigError(f"model.frozen_stages={cfg.model.frozen_stages} must be 0..4 (layer4 is the box head and "
                          "always trains)")
    if not cfg.model.anchor_sizes or any(size <= 0 for size in cfg.model.anchor_sizes):
        raise ConfigError(f"model.anchor_sizes={list(cfg.model.anchor_sizes)} must be positive pixel sizes")
    if not cfg.model.aspect_ratios or any(ratio <= 0 for ratio in cfg.model.aspect_ratios):
        raise ConfigError(f"model.aspect_ratios={list(cfg.model.aspect_ratios)} must be positive (height / width)")
    return cfg


def default_config_path() -> Path:
    """The default config, relative to the working directory, else the repository's copy."""
    local = Path(DEFAULT_CONFIG)
    return local if local.is_file() else REPOSITORY_ROOT / DEFAULT_CONFIG


# ============ the detector ============


def freeze_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every BatchNorm2d under `module` by torchvision's FrozenBatchNorm2d with its statistics and affine."""
    from torchvision.ops import FrozenBatchNorm2d

    if isinstance(module, nn.BatchNorm2d):
        frozen = FrozenBatchNorm2d(module.num_features, eps=module.eps)
        with torch.no_grad():
            frozen.weight.copy_(module.weight)
            frozen.bias.copy_(module.bias)
            frozen.running_mean.copy_(module.running_mean)
            frozen.running_var.copy_(module.running_var)
        return frozen
    for name, child in module.named_children():
        setattr(module, name, freeze_batchnorm(child))
    return module


class ResNetTrunk(nn.Module):
    """The stem and layer1-layer3 of a timm ResNet: the feature map the RPN and RoIAlign read (C4)."""

    def __init__(self, resnet: nn.Module):
        super().__init__()
        self.stem = nn.Sequential(resnet.conv1, resnet.bn1, resnet.act1, resnet.maxpool)
        self.layer1, self.layer2, self.layer3 = resnet.layer1, resnet.layer2, resnet.layer3
        self.out_channels = next(info["num_chs"] for info in resnet.feature_info if info["module"] == "layer3")

    def stages(self) -> list[nn.Module]:
        return [self.stem, self.layer1, self.layer2, self.layer3]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.layer3(self.layer2(self.layer1(self.stem(images))))


class OnePixelConv2d(StridedConv2d):
    """nn.Conv2d that computes a convolution with a 1 x 1 output as one matrix product over the kernel taps
    that overlap the input (the other taps only ever see zero padding): the same numbers, far faster.

    With `model.roi_output_size=2` the C4 box head runs layer4 on hundreds of 2 x 2 RoIs per batch, so every
    convolution there has a 1 x 1 output. oneDNN (torch 2.13, CPU) computes each as a full padded
    convolution, and its backward is 5-10x slower than its forward: it was more than half of a training
    iteration. Any other convolution (a larger output, groups, dilation, other padding modes) goes to
    nn.Conv2d (through StridedConv2d, whose guard for CPU bf16 stays in place).
    """

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.groups == 1 and self.padding_mode == "zeros" and self.dilation == (1, 1) \
                and not isinstance(self.padding, str):
            (height, width), (kernel_h, kernel_w) = input.shape[-2:], self.kernel_size
            (pad_h, pad_w), (stride_h, stride_w) = self.padding, self.stride
            one_pixel = ((height + 2 * pad_h - kernel_h) // stride_h + 1,
                         (width + 2 * pad_w - kernel_w) // stride_w + 1) == (1, 1)
            # the output pixel sees padded rows 0..kernel_h-1: input rows 0..rows-1 meet taps pad_h..pad_h+rows-1
            rows, cols = min(height, kernel_h - pad_h), min(width, kernel_w - pad_w)
            if one_pixel and rows > 0 and cols > 0:
                window = input[:, :, :rows, :cols].flatten(1)
                taps = weight[:, :, pad_h:pad_h + rows, pad_w:pad_w + cols].flatten(1)
                return nn.functional.linear(window, taps, bias)[:, :, None, None]
        return super()._conv_forward(input, weight, bias)


class ResNetC5BoxHead(nn.Module):
    """layer4 of the ResNet on each RoI, then global average pooling: the box head of R50-C4."""

    def __init__(self, resnet: nn.Module):
        super().__init__()
        self.layer4 = resnet.layer4
        for module in self.layer4.modules():
            if isinstance(module, nn.Conv2d):
                module.__class__ = OnePixelConv2d          # same parameters and state_dict; see its docstring
        self.out_channels = int(resnet.num_features)

    def forward(self, rois: torch.Tensor) -> torch.Tensor:
        return self.layer4(rois).mean(dim=(2, 3))


def build_detector(resnet: nn.Module, cfg: DictConfig, num_classes: int, image_size: int,
                   mean: list[float], std: list[float]) -> nn.Module:
    """Faster R-CNN (C4) on `resnet`; `num_classes` counts the object classes (background is added)."""
    from torchvision.models.detection import FasterRCNN
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
    from torchvision.ops import MultiScaleRoIAlign

    m = cfg.model
    trunk, box_head = ResNetTrunk(resnet), ResNetC5BoxHead(resnet)
    for stage in trunk.stages()[:m.frozen_stages]:
        freeze_batchnorm(stage)
        stage.requires_grad_(False)
    if m.norm == "frozen":
        freeze_batchnorm(trunk)
        freeze_batchnorm(box_head)
    anchors = AnchorGenerator(sizes=(tuple(int(s) for s in m.anchor_sizes),),
                              aspect_ratios=(tuple(float(r) for r in m.aspect_ratios),))
    roi_align = MultiScaleRoIAlign(featmap_names=["0"], output_size=m.roi_output_size, sampling_ratio=2)
    return FasterRCNN(
        trunk, min_size=image_size, max_size=image_size, image_mean=list(mean), image_std=list(std),
        rpn_anchor_generator=anchors, rpn_batch_size_per_image=m.rpn_batch_size_per_image,
        rpn_pre_nms_top_n_train=m.rpn_pre_nms_top_n_train, rpn_post_nms_top_n_train=m.rpn_post_nms_top_n_train,
        rpn_pre_nms_top_n_test=m.rpn_pre_nms_top_n_test, rpn_post_nms_top_n_test=m.rpn_post_nms_top_n_test,
        box_roi_pool=roi_align, box_head=box_head,
        box_predictor=FastRCNNPredictor(box_head.out_channels, num_classes + 1),
        box_batch_size_per_image=m.box_batch_size_per_image, box_score_thresh=m.box_score_thresh,
        box_detections_per_img=m.box_detections_per_img)


def detection_backbone(export: BackboneExport, init: str, seed: int) -> nn.Module:
    """The exported ResNet (`init="export"`) or the same architecture at random initialisation."""
    import timm

    if not isinstance(export.backbone, timm.models.resnet.ResNet):
        raise DetectionInputError(f"{export.path} holds a {export.arch!r} backbone; the detection command supports "
                                  "ResNets (timm resnet*) only: pretrain a ResNet (model.arch=resnet18 / resnet50)")
    if init == "export":
        return export.backbone
    torch.manual_seed(seed)
    zero_init = bool(export.config.get("model", {}).get("zero_init_residual", False))
    return create_backbone(export.arch, export.stem, zero_init_residual=zero_init)


# ============ data ============


@dataclass
class SceneSplit:
    """One split of a COCO detection set, in memory: uint8 images and torchvision targets."""

    json_path: Path
    image_ids: list[int]
    images: torch.Tensor                     # (N, 3, H, W) uint8
    targets: list[dict[str, torch.Tensor]]   # boxes (k, 4) float x0, y0, x1, y1; labels (k,) int64 1..K
    num_classes: int


def load_split(json_path: Path, image_folder: Path) -> SceneSplit:
    """Read a COCO instances file and its images (all of one size) into memory."""
    try:
        coco = json.loads(json_path.read_text())
        categories = sorted(category["id"] for category in coco["categories"])
        records = coco["images"]
        by_image: dict[int, list[dict]] = {record["id"]: [] for record in records}
        for annotation in coco["annotations"]:
            by_image[annotation["image_id"]].append(annotation)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DetectionInputError(f"{json_path} is not a COCO instances file ({type(error).__name__}: {error}); "
                                  "rewrite it with `python -m transfer digit-scenes --force`") from None
    if categories != list(range(1, len(categories) + 1)):
        raise DetectionInputError(f"{json_path}: category ids {categories} are not 1..K")
    images, targets = [], []
    for record in records:
        path = image_folder / record["file_name"]
        image = cv2.imread(str(path), cv2.IMREAD_COLOR)
        if image is None:
            raise DetectionInputError(f"cannot read image {path} listed in {json_path}; rewrite the set with "
                                      "`python -m transfer digit-scenes --force`")
        images.append(torch.from_numpy(cv2.cvtColor(image, cv2.COLOR_BGR2RGB)).permute(2, 0, 1))
        boxes = [[x, y, x + w, y + h] for x, y, w, h in (a["bbox"] for a in by_image[record["id"]])]
        targets.append({"boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
                        "labels": torch.tensor([a["category_id"] for a in by_image[record["id"]]], dtype=torch.int64)})
    sizes = {tuple(image.shape) for image in images}
    if len(sizes) != 1:
        raise DetectionInputError(f"{json_path}: images of several sizes {sorted(sizes)}; the digit scenes are square "
                                  "and of one size")
    return SceneSplit(json_path=json_path, image_ids=[record["id"] for record in records], images=torch.stack(images),
                      targets=targets, num_classes=len(categories))


def prepare_scenes(cfg: DictConfig) -> dict[str, Path]:
    """The digit-scenes paths of `data.root`, written first when absent (unless data.generate=false)."""
    d = cfg.data
    root = Path(d.root)
    complete = (root / "train.json").is_file() and (root / "val.json").is_file()
    if not complete and not d.generate:
        raise DetectionInputError(f"no digit scenes at {root} (train.json and val.json): write them with "
                                  f"`python -m transfer digit-scenes --out-dir {root}` or set data.generate=true")
    if not complete:
        print(f"writing the digit scenes to {root} ({d.num_train} train / {d.num_val} val, {d.image_size} px)",
              flush=True)
    try:
        return write_digit_scenes(root, num_train=d.num_train, num_val=d.num_val, image_size=d.image_size,
                                  seed=d.seed)
    except DigitScenesError as error:
        raise DetectionInputError(f"{error} (or set data.root / data.num_train / data.num_val / data.image_size to "
                                  "match the set)") from None


# ============ training ============


def learning_rates(cfg: DictConfig, total_iters: int) -> np.ndarray:
    """The lr of every iteration: linear warm-up from 0.1% of train.lr, then a cosine to 0."""
    t = cfg.train
    iters = np.arange(total_iters, dtype=np.float64)
    warmup = max(min(t.warmup_iters, total_iters), 0)
    cosine = 0.5 * t.lr * (1 + np.cos(np.pi * (iters - warmup) / max(total_iters - warmup, 1)))
    ramp = t.lr * (0.001 + (1 - 0.001) * iters / max(warmup, 1))
    return np.where(iters < warmup, ramp, cosine)


def batch_of(split: SceneSplit, indices: torch.Tensor, device: torch.device) -> tuple[list, list]:
    images = [split.images[i].to(device).float().div_(255) for i in indices.tolist()]
    targets = [{key: value.to(device) for key, value in split.targets[i].items()} for i in indices.tolist()]
    return images, targets


def train_detector(model: nn.Module, train: SceneSplit, cfg: DictConfig, device: torch.device) -> dict[str, Any]:
    """Train `model` on `train`; returns the iterations run and the mean loss of the last `print_every`."""
    t = cfg.train
    per_epoch = max(len(train.image_ids) // t.batch_size, 1)
    total = per_epoch * t.epochs
    stop = min(total, t.max_iters) if t.max_iters else total
    lrs = learning_rates(cfg, total)
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(parameters, lr=float(lrs[0]), momentum=t.momentum, weight_decay=t.weight_decay)
    generator = torch.Generator().manual_seed(cfg.seed)
    model.train()
    started, recent = time.perf_counter(), []
    order = torch.empty(0, dtype=torch.long)
    for iteration in range(stop):
        if iteration % per_epoch == 0:
            order = torch.randperm(len(train.image_ids), generator=generator)
        position = (iteration % per_epoch) * t.batch_size
        images, targets = batch_of(train, order[position:position + t.batch_size], device)
        for group in optimizer.param_groups:
            group["lr"] = float(lrs[iteration])
        losses = model(images, targets)
        loss = sum(losses.values())
        if not torch.isfinite(loss):
            parts = ", ".join(f"{name} {value.item():.4g}" for name, value in losses.items())
            raise FloatingPointError(f"the detection loss is not finite at iteration {iteration + 1} ({parts}); "
                                     f"lower train.lr={t.lr} or set train.grad_clip (e.g. 10)")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(parameters, t.grad_clip)
        optimizer.step()
        recent = (recent + [{name: value.item() for name, value in losses.items()}])[-t.print_every:]
        if (iteration + 1) % t.print_every == 0 or iteration + 1 == stop:
            elapsed = time.perf_counter() - started
            means = {name: sum(r[name] for r in recent) / len(recent) for name in recent[-1]}
            parts = "  ".join(f"{name.removeprefix('loss_')} {value:.3f}" for name, value in means.items())
            print(f"  iter {iteration + 1:5d}/{stop}  epoch {iteration // per_epoch + 1}  lr {lrs[iteration]:.4f}  "
                  f"loss {sum(means.values()):.3f} ({parts})  {elapsed:.0f} s, "
                  f"{elapsed / (iteration + 1) * (stop - iteration - 1):.0f} s left", flush=True)
    final = {name: sum(r[name] for r in recent) / len(recent) for name in recent[-1]} if recent else {}
    return {"iterations": stop, "iterations_per_epoch": per_epoch, "final_losses": final}


# ============ evaluation ============


@torch.no_grad()
def predict(model: nn.Module, split: SceneSplit, batch_size: int, device: torch.device) -> list[dict]:
    """The detections of `model` on every image of `split`, in COCO's results format (bbox x, y, w, h)."""
    model.eval()
    detections = []
    for start in range(0, len(split.image_ids), batch_size):
        indices = torch.arange(start, min(start + batch_size, len(split.image_ids)))
        images, _ = batch_of(split, indices, device)
        for index, output in zip(indices.tolist(), model(images)):
            for box, score, label in zip(output["boxes"].cpu().tolist(), output["scores"].cpu().tolist(),
                                         output["labels"].cpu().tolist()):
                x0, y0, x1, y1 = box
                detections.append({"image_id": split.image_ids[index], "category_id": int(label),
                                   "bbox": [round(x0, 2), round(y0, 2), round(x1 - x0, 2), round(y1 - y0, 2)],
                                   "score": round(float(score), 5)})
    return detections


COCO_STATISTICS = ("map", "ap50", "ap75", "ap_small", "ap_medium", "ap_large", "ar_1", "ar_10", "ar_100",
                   "ar_small", "ar_medium", "ar_large")


def coco_box_metrics(ground_truth: str | Path, detections: list[dict]) -> tuple[dict[str, float], str]:
    """COCOeval (bbox) of `detections` against the COCO instances file `ground_truth`.

    Returns ({map, ap50, ap75, ap_small, ..., ar_large}: COCOeval's 12 statistics in its order, map being
    AP@[0.50:0.95] with 101-point interpolation), and COCOeval's printed summary. No detections scores 0.
    """
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):                     # pycocotools prints progress on stdout
        coco_gt = COCO(str(ground_truth))
        if not detections:
            return {name: 0.0 for name in COCO_STATISTICS}, "no detections: every AP is 0\n"
        # loadRes adds keys (id, area, segmentation) to the dicts it is given: hand it copies
        evaluation = COCOeval(coco_gt, coco_gt.loadRes([dict(d) for d in detections]), "bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        summary_start = printed.tell()
        evaluation.summarize()
    summary = printed.getvalue()[summary_start:]
    return {name: float(value) for name, value in zip(COCO_STATISTICS, evaluation.stats)}, summary


# ============ outputs ============


def write_results(run_dir: Path, export: BackboneExport, init: str, metrics: dict[str, float],
                  detections: list[dict], details: dict[str, Any]) -> Path:
    """RUN_DIR/eval/detection_{init}_stepNNNNNNN.json, its detections file, and TensorBoard scalars."""
    from torch.utils.tensorboard import SummaryWriter   # slow import; only pay for it here

    stem = f"detection_{init}_step{export.step:07d}"
    path = run_dir / "eval" / f"{stem}.json"
    detections_path = path.with_name(f"{stem}_detections.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    detections_path.write_text(json.dumps(detections))
    result = {"protocol": "detection", "from": init, "step": export.step, "epoch": export.epoch,
              "checkpoint": str(export.path), "arch": export.arch, "stem": export.stem,
              "map": metrics["map"], "ap50": metrics["ap50"], "coco_stats": metrics,
              "metric": "pycocotools COCOeval bbox: map = AP@[0.50:0.95], 101-point interpolated; ap50 = AP@0.50",
              "detections": str(detections_path), **details}
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)
    prefix = "eval/detection_" if init == "export" else "eval/detection_random_"
    writer = SummaryWriter(log_dir=str(run_dir / "tb"))
    writer.add_scalar(prefix + "map", metrics["map"], global_step=export.step)
    writer.add_scalar(prefix + "ap50", metrics["ap50"], global_step=export.step)
    writer.close()
    return path


# ============ command line ============


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", dest="run_dir", required=True, metavar="RUN_DIR",   # not `run`: __main__ sets args.run
                        help="pretraining run directory: reads RUN_DIR/backbone.pth, writes RUN_DIR/eval and RUN_DIR/tb")
    parser.add_argument("--config", metavar="FILE",
                        help=f"detection config YAML (default: {DEFAULT_CONFIG}; keys in this command's docstring)")
    parser.add_argument("--from", dest="init", choices=("export", "random"), default="export",
                        help="initialise the detector's ResNet from the export, or at random with the same "
                             "architecture (the baseline) (default: %(default)s)")
    parser.add_argument("--device", default="auto",
                        help="auto (CUDA when available), cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. train.epochs=2 data.root=/tmp/scenes model.norm=frozen")


def run_detection(args: argparse.Namespace) -> Path:
    """Train and evaluate the detector as `args` say; returns the result JSON written."""
    started = time.perf_counter()
    run_dir = Path(args.run_dir)
    checkpoint = resolve_checkpoint_path(run_dir, None)
    cfg = load_detection_config(args.config or default_config_path(), args.overrides)
    device = resolve_device(args.device)
    export = load_backbone_export(checkpoint)
    data = export.config.get("data", {})
    mean, std = data.get("mean"), data.get("std")
    if mean is None or std is None:
        raise DetectionInputError(f"the config in {checkpoint} has no data.mean / data.std to normalise images with; "
                                  "re-export the backbone from a run with a complete config")
    resnet = detection_backbone(export, args.init, cfg.seed)
    paths = prepare_scenes(cfg)
    train, val = (load_split(paths[f"{split}_json"], paths[f"{split}_images"]) for split in ("train", "val"))
    image_size = int(train.images.shape[-1])
    torch.manual_seed(cfg.seed)              # the RPN and the box predictor start from this seed
    model = build_detector(resnet, cfg, train.num_classes, image_size, mean, std).to(device)
    print(f"detection on digit scenes: Faster R-CNN (C4) on {export.arch} (stem {export.stem}) from "
          f"{'the export of step ' + str(export.step) if args.init == 'export' else 'random initialisation'}, "
          f"{len(train.image_ids)} train / {len(val.image_ids)} val scenes of {image_size} px, {device}", flush=True)
    train_started = time.perf_counter()
    training = train_detector(model, train, cfg, device)
    train_seconds = time.perf_counter() - train_started
    detections = predict(model, val, cfg.eval.batch_size, device)
    metrics, summary = coco_box_metrics(val.json_path, detections)
    seconds = time.perf_counter() - started
    details = {"train": str(paths["train_json"]), "val": str(paths["val_json"]), "num_train": len(train.image_ids),
               "num_val": len(val.image_ids), "num_detections": len(detections), "device": str(device),
               "train_seconds": round(train_seconds, 1), "seconds": round(seconds, 1), **training,
               "config": OmegaConf.to_container(cfg, resolve=True)}
    path = write_results(run_dir, export, args.init, metrics, detections, details)
    print(summary, end="")
    print(f"detection from {args.init}: mAP {100 * metrics['map']:.2f}  AP50 {100 * metrics['ap50']:.2f}  "
          f"({training['iterations']} iterations, {train_seconds:.0f} s training, {seconds:.0f} s in all)")
    print(f"results: {path}")
    return path


def run(args: argparse.Namespace) -> int:
    try:
        run_detection(args)
    except (EvaluationInputError, DetectionInputError, ConfigError) as error:
        # OmegaConf's type errors span several lines (value, full_key, types): one line, all of it
        print("error: " + " ".join(line.strip() for line in str(error).splitlines()), file=sys.stderr)
        return 2
    except FloatingPointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0
