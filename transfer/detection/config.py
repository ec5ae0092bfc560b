"""The detection config: a typed schema, the YAML file configs/transfer/detection_digit_scenes.yaml, `key=value`
overrides (values are YAML: `optim.epochs=2`, `model.anchor_sizes=[16,32]`). An unknown key is refused with the
closest valid one; every key, its default and its meaning are in the dataclasses below.

The sections `optim` and `engine` are those of pretraining and fine-tuning (pretrain/runtime/config.py: the same
optimizers, schedule, checkpoint and logging keys), with detection's defaults: SGD at an lr of 0.02 not scaled with
the batch, a warm-up from 0.1% of it (`optim.warmup_start_factor`, detection's own key), fp32, one checkpoint kept.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pretrain.runtime.config import (RUNTIME_CHOICES, RUNTIME_RANGES, EngineConfig, OptimConfig,
                                     check_choices_and_ranges, check_optim_keys, merge_checked, parse_overrides,
                                     read_config_file, schema_keys)
from pretrain.runtime.config_error import ConfigError

DEFAULT_CONFIG = "configs/transfer/detection_digit_scenes.yaml"
REPOSITORY_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class DataOptions:
    """The digit scenes (transfer/digit_scenes.py), written to `root` on first use."""
    root: str = "data/digit_scenes"          # the set's folder: train.json, val.json, train/, val/
    num_train: int = 2000                    # scenes per split when the set is written
    num_val: int = 500
    image_size: int = 96                     # scene side in px when the set is written
    seed: int = 0                            # seed of the set when it is written
    generate: bool = True                    # write the set when `root` holds none; false: refuse
    batch_size: int = 8                      # training scenes per iteration and process
    eval_batch_size: int = 32                # val scenes per forward


@dataclass
class ModelOptions:
    """The Faster R-CNN C4 of transfer/detector.py."""
    anchor_sizes: list[int] = field(default_factory=lambda: [16, 24, 32, 48])   # anchor sides in px (one map)
    aspect_ratios: list[float] = field(default_factory=lambda: [0.5, 1.0, 2.0])  # anchor height / width
    roi_output_size: int = 4                 # RoIAlign output side on the layer3 map (layer4 halves it)
    # BatchNorm: train (batch statistics, updated running statistics, learned affine; as MoCo's SyncBN) or frozen
    # (the export's statistics and affine, fixed: torchvision's FrozenBatchNorm2d).
    norm: str = "train"
    # Stages whose weights stay fixed: 0 none, 1 the stem, 2 the stem and layer1, 3 also layer2, 4 also layer3
    # (their BatchNorm is then frozen too).
    frozen_stages: int = 0
    rpn_batch_size_per_image: int = 128      # anchors sampled per image for the RPN loss
    rpn_pre_nms_top_n_train: int = 600       # proposals kept before / after NMS, training
    rpn_post_nms_top_n_train: int = 200
    rpn_pre_nms_top_n_test: int = 300        # the same, evaluation
    rpn_post_nms_top_n_test: int = 100
    box_batch_size_per_image: int = 64       # proposals sampled per image for the box-head loss (25% positive)
    box_score_thresh: float = 0.01           # detections scoring less are dropped before COCOeval
    # At most this many detections per image (COCOeval scores up to 100, torchvision's and Detectron2's default;
    # the digit scenes' config keeps 20).
    box_detections_per_img: int = 100


@dataclass
class DetectionOptimConfig(OptimConfig):
    """Pretraining's optim.* keys with detection's defaults."""
    lr: float = 0.02                         # the peak lr, not scaled with the batch (lr_scaling: none)
    lr_scaling: str = "none"
    warmup_epochs: float = 0.2               # 50 iterations of the digit scenes' 250 per epoch
    epochs: int = 4
    # The warm-up starts at this fraction of the peak lr (Detectron2's WARMUP_FACTOR); pretraining's starts from 0.
    warmup_start_factor: float = 0.001


@dataclass
class DetectionEngineConfig(EngineConfig):
    """Pretraining's engine.* keys with detection's defaults: one process per GPU or the CPU, fp32, one
    checkpoint kept (written at every epoch end), progress and scalars every 25 iterations."""
    precision: str = "fp32"
    keep_checkpoints: int = 1
    log_every_steps: int = 25
    print_every_steps: int = 25              # also: the final losses of the result average this many iterations
    image_grid_every_steps: int = 0


@dataclass
class DetectionConfig:
    seed: int = 0                            # seed of the random init, the new layers and the batch order
    data: DataOptions = field(default_factory=DataOptions)
    model: ModelOptions = field(default_factory=ModelOptions)
    optim: DetectionOptimConfig = field(default_factory=DetectionOptimConfig)
    engine: DetectionEngineConfig = field(default_factory=DetectionEngineConfig)


CONFIG_KEYS = tuple(schema_keys(DetectionConfig))
KEYS_WHERE = "transfer/detection/config.py (optim.* and engine.* in pretrain/runtime/config.py)"

# (key, smallest allowed value): integers and numbers outside these ranges are refused by name; the optim.* and
# engine.* ranges are pretraining's (RUNTIME_RANGES).
LOWER_BOUNDS = (("seed", 0), ("data.num_train", 1), ("data.num_val", 1), ("data.image_size", 32), ("data.seed", 0),
                ("data.batch_size", 1), ("data.eval_batch_size", 1),
                ("model.roi_output_size", 1), ("model.frozen_stages", 0), ("model.rpn_batch_size_per_image", 1),
                ("model.rpn_pre_nms_top_n_train", 1), ("model.rpn_post_nms_top_n_train", 1),
                ("model.rpn_pre_nms_top_n_test", 1), ("model.rpn_post_nms_top_n_test", 1),
                ("model.box_batch_size_per_image", 1), ("model.box_score_thresh", 0.0),
                ("model.box_detections_per_img", 1), ("optim.warmup_start_factor", 0.0))


def load_detection_config(path: str | Path | None, overrides: list[str] = ()) -> DictConfig:
    """Schema defaults <- YAML file <- `key=value` overrides, every key and value checked (ConfigError)."""
    tree = read_config_file(path, "configs/transfer/") if path is not None else {}
    cfg = merge_checked(OmegaConf.structured(DetectionConfig), CONFIG_KEYS, tree, parse_overrides(list(overrides)),
                        KEYS_WHERE)
    for key, bound in LOWER_BOUNDS:
        value = OmegaConf.select(cfg, key)
        if not math.isfinite(value) or value < bound:
            raise ConfigError(f"{key}={value} must be a finite number >= {bound}")
    check_choices_and_ranges(cfg, RUNTIME_CHOICES, RUNTIME_RANGES)
    check_optim_keys(cfg)
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
