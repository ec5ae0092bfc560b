"""Detection on the digit scenes: a torchvision Faster R-CNN on the exported ResNet, scored with COCO mAP.

    python -m transfer detection --run RUN_DIR [--config FILE] [key=value ...] [--from export|random]

The detector (transfer/detector.py) is torchvision's Faster R-CNN in the R50-C4 layout that MoCo's detection
protocol uses, built on the pretraining run's backbone export (RUN_DIR/backbone.pth, loaded as `python -m eval`
loads it):
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

Training runs through the training loop of every stage (pretrain/runtime/loop.py), on the CPU or one GPU per process
(`--device auto` takes CUDA when there is one): SGD with momentum, linear warm-up then cosine decay of the
learning rate, fixed-size batches in a seeded random order, fp32. The detector's run directory,
RUN_DIR/detection/detection_{export|random}_stepNNNNNNN/, holds its checkpoints (one, at the last epoch end),
config.yaml, metrics.jsonl and TensorBoard curves: a killed or stopped run (SIGINT / SIGTERM / SIGUSR1 / SIGUSR2 save a
checkpoint, exit 128 + N) resumes by rerunning the same command; a finished one is evaluated again without
training. Evaluation runs the detector on the val scenes and scores its detections with
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
    model.box_detections_per_img [100] at most this many detections per image (COCOeval scores up to 100,
                                       torchvision's and Detectron2's default; the digit scenes' config keeps 20)
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
import time
from collections import deque
from collections.abc import Iterator
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
from eval.results import result_path, write_result
from pretrain.models import create_backbone
from pretrain.runtime.atomic_write import write_text_atomically
from pretrain.runtime.checkpoint import check_resumable
from pretrain.runtime.config import merge_checked, parse_overrides, read_config_file, schema_keys
from pretrain.runtime.config_error import ConfigError
from pretrain.runtime.distributed import average_buffers
from pretrain.runtime.loop import LoopOptions, Stage, run_training
from pretrain.runtime.optim import Schedules, cosine_schedule
from pretrain.runtime.task import BatchLoss, BatchPosition, TrainingTask
from transfer.detector import build_detector
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
    box_detections_per_img: int = 100


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
LOWER_BOUNDS = (("seed", 0), ("data.num_train", 1), ("data.num_val", 1), ("data.image_size", 32), ("data.seed", 0),
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


# ============ the backbone ============


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


# ============ training: a stage of the training loop ============


def learning_rates(cfg: DictConfig, total_iters: int) -> np.ndarray:
    """The lr of every iteration: linear warm-up from 0.1% of train.lr over train.warmup_iters, then a cosine to 0."""
    return cosine_schedule(cfg.train.lr, 0.0, total_iters, cfg.train.warmup_iters, warmup_start=0.001 * cfg.train.lr)


def batch_of(split: SceneSplit, indices: torch.Tensor, device: torch.device) -> tuple[list, list]:
    images = [split.images[i].to(device).float().div_(255) for i in indices.tolist()]
    targets = [{key: value.to(device) for key, value in split.targets[i].items()} for i in indices.tolist()]
    return images, targets


@dataclass
class SceneBatch:
    images: list[torch.Tensor]                # (3, H, W) in [0, 1]
    targets: list[dict[str, torch.Tensor]]

    @property
    def batch_size(self) -> int:
        return len(self.images)


class SceneLoader:
    """The training scenes in a seeded random order, a new permutation every epoch: epoch e's is the (e+1)-th draw
    of one generator seeded with `seed`, so a resumed run reads what the uninterrupted one read. Each rank takes its
    share of every global batch of batch_size x world_size scenes; an epoch holds len(split) // that many batches
    (at least one, a partial one when the set is smaller than a batch)."""

    def __init__(self, split: SceneSplit, batch_size: int, seed: int, rank: int, world_size: int,
                 device: torch.device):
        self.split, self.batch_size, self.seed = split, batch_size, seed
        self.rank, self.world_size, self.device = rank, world_size, device
        self.num_images = len(split.image_ids)
        if world_size > 1 and self.num_images < batch_size * world_size:
            raise ConfigError(f"{self.num_images} training scenes do not fill one batch of train.batch_size="
                              f"{batch_size} on each of {world_size} processes: lower train.batch_size")

    def __len__(self) -> int:
        return max(self.num_images // (self.batch_size * self.world_size), 1)

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[SceneBatch]:
        generator = torch.Generator().manual_seed(self.seed)
        for _ in range(epoch + 1):
            order = torch.randperm(self.num_images, generator=generator)
        for batch in range(start_batch, len(self)):
            start = (batch * self.world_size + self.rank) * self.batch_size
            yield SceneBatch(*batch_of(self.split, order[start:start + self.batch_size], self.device))


class DetectionTask(TrainingTask):
    """The detector as the training loop's task: images + boxes -> the detector's losses (RPN objectness and box
    regression, box-head classification and regression), summed."""

    def __init__(self, detector: nn.Module, print_every: int):
        super().__init__()
        self.detector = detector
        self.recent: deque[dict[str, float]] = deque(maxlen=print_every)   # the last losses, for the result

    def forward(self, images: list[torch.Tensor], targets: list[dict] | None = None):
        return self.detector(images, targets)

    def batch_loss(self, engine, batch: SceneBatch, position: BatchPosition, autocast) -> BatchLoss:
        with autocast():
            losses = engine(batch.images, batch.targets)
        parts = {name: value.item() for name, value in losses.items()}
        self.recent.append(parts)
        return BatchLoss(sum(losses.values()), {f"train/{name}": value for name, value in parts.items()})

    def final_losses(self) -> dict[str, float]:
        """The mean of each loss over the last train.print_every iterations."""
        return {name: sum(r[name] for r in self.recent) / len(self.recent) for name in self.recent[-1]} \
            if self.recent else {}


# What a resumed detection run must share with the run in its directory (train.max_iters and print_every may change).
RESUME_KEYS = ("seed", "data", "model", "train.epochs", "train.batch_size", "train.lr", "train.momentum",
               "train.weight_decay", "train.warmup_iters", "train.grad_clip")


@dataclass
class DetectionInputs:
    """What a detection run reads, resolved and checked before it starts."""

    export: BackboneExport
    run_dir: Path                # the pretraining run: results go to RUN_DIR/eval and RUN_DIR/tb
    init: str                    # export | random
    device: str                  # auto | cpu
    mean: list[float]
    std: list[float]
    paths: dict[str, Path]
    train: SceneSplit
    val: SceneSplit

    @property
    def training_dir(self) -> Path:
        """RUN_DIR/detection/detection_{init}_stepNNNNNNN: the detector's checkpoints, logs and config."""
        return self.run_dir / "detection" / f"detection_{self.init}_step{self.export.step:07d}"


class DetectionTraining(Stage):
    """The detector's training run: Faster R-CNN (C4) on the export, SGD with the warm-up + cosine lr."""

    name = "detection"

    def __init__(self, cfg: DictConfig, inputs: DetectionInputs):
        self.cfg, self.inputs = cfg, inputs
        self.run_dir = inputs.training_dir
        t = cfg.train
        # One process (or one per GPU under a launcher), fp32, ZeRO 0; a checkpoint at every epoch end.
        self.options = LoopOptions(epochs=t.epochs, batch_size=t.batch_size, grad_clip=t.grad_clip, seed=cfg.seed,
                                   precision="fp32", max_steps=t.max_iters, log_every_steps=t.print_every,
                                   print_every_steps=t.print_every, keep_checkpoints=1, device=inputs.device)
        self.started = time.perf_counter()

    def check_resumable(self) -> None:
        check_resumable(self.run_dir / "config.yaml", self.cfg, RESUME_KEYS)

    def divergence_advice(self) -> str:
        return f"Lower train.lr (now {self.cfg.train.lr}) or set train.grad_clip (e.g. 10)."

    def build_loader(self, rank: int, world_size: int, device: torch.device) -> SceneLoader:
        return SceneLoader(self.inputs.train, self.cfg.train.batch_size, self.cfg.seed, rank, world_size, device)

    def build_task(self, steps_per_epoch: int, device: torch.device) -> DetectionTask:
        i = self.inputs
        resnet = detection_backbone(i.export, i.init, self.cfg.seed)
        torch.manual_seed(self.cfg.seed)              # the RPN and the box predictor start from this seed
        detector = build_detector(resnet, self.cfg, i.train.num_classes, int(i.train.images.shape[-1]), i.mean, i.std)
        return DetectionTask(detector.to(device), self.cfg.train.print_every)

    def schedules(self, steps_per_epoch: int, global_batch: int) -> Schedules:
        total = steps_per_epoch * self.cfg.train.epochs
        return Schedules(peak_lr=self.cfg.train.lr, lr=learning_rates(self.cfg, total),
                         weight_decay=np.full(total, self.cfg.train.weight_decay))

    def build_optimizer(self, task: DetectionTask, peak_lr: float) -> torch.optim.Optimizer:
        t = self.cfg.train
        return torch.optim.SGD(task.param_groups(), lr=peak_lr, momentum=t.momentum, weight_decay=t.weight_decay)

    def record(self, task: DetectionTask, steps_per_epoch: int, rank: int) -> None:
        self.steps_per_epoch = steps_per_epoch
        if rank == 0:
            write_text_atomically(self.run_dir / "config.yaml", OmegaConf.to_yaml(self.cfg, resolve=True))

    def finish(self, engine, task: DetectionTask, step: int, epoch: int, rank: int) -> Path | None:
        """Evaluate the trained detector on the val scenes (rank 0) and write the result."""
        i = self.inputs
        train_seconds = time.perf_counter() - self.started
        average_buffers(task)
        if rank != 0:
            return None
        device = next(task.parameters()).device
        detections = predict(task.detector, i.val, self.cfg.eval.batch_size, device)
        metrics, summary = coco_box_metrics(i.val.json_path, detections)
        seconds = time.perf_counter() - self.started
        details = {"train": str(i.paths["train_json"]), "val": str(i.paths["val_json"]),
                   "num_train": len(i.train.image_ids), "num_val": len(i.val.image_ids),
                   "num_detections": len(detections), "device": str(device), "training_dir": str(self.run_dir),
                   "train_seconds": round(train_seconds, 1), "seconds": round(seconds, 1), "iterations": step,
                   "iterations_per_epoch": self.steps_per_epoch, "final_losses": task.final_losses(),
                   "config": OmegaConf.to_container(self.cfg, resolve=True)}
        path = write_detection_result(i, metrics, detections, details)
        print(summary, end="")
        print(f"detection from {i.init}: mAP {100 * metrics['map']:.2f}  AP50 {100 * metrics['ap50']:.2f}  "
              f"(at most {self.cfg.model.box_detections_per_img} detections per image; {step} iterations, {train_seconds:.0f} s training, {seconds:.0f} s in all)")
        print(f"results: {path}")
        return path

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


def write_detection_result(inputs: DetectionInputs, metrics: dict[str, float], detections: list[dict],
                           details: dict[str, Any]) -> Path:
    """RUN_DIR/eval/detection_{init}_stepNNNNNNN.json, its detections file (..._detections.json) and TensorBoard
    scalars, through eval's one result writer."""
    export, init = inputs.export, inputs.init
    name = f"detection_{init}"
    result = {"protocol": "detection", "from": init, "step": export.step, "epoch": export.epoch,
              "checkpoint": str(export.path), "arch": export.arch, "stem": export.stem,
              "map": metrics["map"], "ap50": metrics["ap50"], "coco_stats": metrics,
              "metric": "pycocotools COCOeval bbox: map = AP@[0.50:0.95], 101-point interpolated; ap50 = AP@0.50",
              "max_detections_per_image": details["config"]["model"]["box_detections_per_img"],
              "detections": str(result_path(inputs.run_dir, name, export.step, "_detections.json")), **details}
    prefix = "eval/detection_" if init == "export" else "eval/detection_random_"
    return write_result(inputs.run_dir, name, export.step, result,
                        {prefix + "map": metrics["map"], prefix + "ap50": metrics["ap50"]},
                        {"_detections.json": json.dumps(detections)})


# ============ command line ============


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", dest="run_dir", required=True, metavar="RUN_DIR",   # not `run`: __main__ sets args.run
                        help="pretraining run directory: reads RUN_DIR/backbone.pth, trains in "
                             "RUN_DIR/detection/detection_{export|random}_stepNNNNNNN (checkpoints: rerun to resume), "
                             "writes RUN_DIR/eval and RUN_DIR/tb")
    parser.add_argument("--config", metavar="FILE",
                        help=f"detection config YAML (default: {DEFAULT_CONFIG}; keys in this command's docstring)")
    parser.add_argument("--from", dest="init", choices=("export", "random"), default="export",
                        help="initialise the detector's ResNet from the export, or at random with the same "
                             "architecture (the baseline) (default: %(default)s)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="auto (CUDA when available), cpu or cuda; under a launcher each process takes the GPU "
                             "of its LOCAL_RANK (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. train.epochs=2 data.root=/tmp/scenes model.norm=frozen")


def resolve_detection_inputs(args: argparse.Namespace, cfg: DictConfig) -> DetectionInputs:
    """The export, the normalisation and the scenes (written first when absent); raises DetectionInputError,
    EvaluationInputError or ConfigError (one line, what to do) for inputs that cannot work."""
    run_dir = Path(args.run_dir)
    checkpoint = resolve_checkpoint_path(run_dir, None)
    resolve_device(args.device)                                  # refuses cuda without a GPU
    export = load_backbone_export(checkpoint)
    data = export.config.get("data", {})
    mean, std = data.get("mean"), data.get("std")
    if mean is None or std is None:
        raise DetectionInputError(f"the config in {checkpoint} has no data.mean / data.std to normalise images with; "
                                  "re-export the backbone from a run with a complete config")
    detection_backbone(export, "export", cfg.seed)               # refuses a backbone that is not a ResNet
    paths = prepare_scenes(cfg)
    train, val = (load_split(paths[f"{split}_json"], paths[f"{split}_images"]) for split in ("train", "val"))
    return DetectionInputs(export=export, run_dir=run_dir, init=args.init,
                           device="cpu" if args.device == "cpu" else "auto", mean=list(mean), std=list(std),
                           paths=paths, train=train, val=val)


def run_detection(args: argparse.Namespace) -> Path:
    """Train (or resume) and evaluate the detector as `args` say; returns the result JSON written."""
    cfg = load_detection_config(args.config or default_config_path(), args.overrides)
    inputs = resolve_detection_inputs(args, cfg)
    print(f"detection on digit scenes: Faster R-CNN (C4) on {inputs.export.arch} (stem {inputs.export.stem}) from "
          f"{'the export of step ' + str(inputs.export.step) if args.init == 'export' else 'random initialisation'}, "
          f"{len(inputs.train.image_ids)} train / {len(inputs.val.image_ids)} val scenes of "
          f"{int(inputs.train.images.shape[-1])} px; training in {inputs.training_dir}", flush=True)
    return run_training(DetectionTraining(cfg, inputs))


def run(args: argparse.Namespace) -> int:
    """The exit status: 0 done, 1 diverged, 2 bad input (one line), 128 + N stopped by signal N (rerun to resume)."""
    from pretrain.runtime.checkpoint import CheckpointError
    from pretrain.runtime.exit_status import exit_status_of
    from pretrain.runtime.monitor import MetricsFileError
    from pretrain.runtime.run_lock import RunDirectoryInUse

    return exit_status_of(lambda: run_detection(args),
                          (EvaluationInputError, DetectionInputError, ConfigError, CheckpointError, RunDirectoryInUse,
                           MetricsFileError), "detection")
