"""The fine-tuning configuration: a typed schema, YAML files under configs/transfer/, `key=value` overrides.

    cfg = load_finetune_config("configs/transfer/finetune_digits.yaml", ["data.label_fraction=10%"])

The sections `optim` and `engine` are those of pretraining (pretrain/runtime/config.py: the same optimizers,
schedule, DeepSpeed and checkpoint keys), `optim` with `layer_decay` added. Data keys left empty (null) take the value
of the export's own config: `data.train` / `data.val` (the pretraining data), `data.image_size` (its first view
size), `data.canvas_size` and `data.eval_crop_fraction`. Normalisation (mean / std) always comes from the export:
the backbone was trained on images normalised that way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf
from timm.data.auto_augment import rand_augment_transform

from pretrain.config import CHOICES, NUMBER_RANGES
from pretrain.data.augment import check_view_group
from pretrain.data.views import ViewGroup
from pretrain.runtime.config import (EngineConfig, OptimConfig, check_choices_and_ranges, check_optim_keys,
                                     check_run_name, merge_checked, parse_overrides, read_config_file, schema_keys)
from pretrain.runtime.config_error import ConfigError

CONFIGS_DIR = "configs/transfer/"


@dataclass
class FinetuneDataConfig:
    train: Optional[str] = None              # .beton or image folder; null: data.train of the export's config
    val: Optional[str] = None                # null: data.val of the export's config
    # The share of the training images whose labels are used: "1%", "10%", "100%" (or a fraction such as 0.1).
    # Below 100% a class-balanced subset is drawn with label_seed and saved with the run (label_subset.json).
    label_fraction: str = "100%"
    label_seed: int = 0
    batch_size: int = 64                     # per process (micro-batch); global = this x processes x grad_accum
    num_workers: int = 2
    image_size: Optional[int] = None         # training crop and evaluation side; null: the export's view size
    canvas_size: Optional[int] = None        # FFCV decode canvas; null: the export's data.canvas_size
    eval_crop_fraction: Optional[float] = None   # null: the export's data.eval_crop_fraction
    eval_batch_size: int = 256


@dataclass
class AugmentConfig:
    """Per-image training augmentation: RandomResizedCrop + flip from the loader, then timm's RandAugment and
    random erasing (DeiT's order)."""
    scale: list[float] = field(default_factory=lambda: [0.08, 1.0])       # RandomResizedCrop area range
    ratio: list[float] = field(default_factory=lambda: [3 / 4, 4 / 3])     # RandomResizedCrop aspect range
    flip_p: float = 0.5
    randaugment: Optional[str] = None        # timm's config string, e.g. rand-m9-mstd0.5-inc1 (DeiT); null: off
    random_erasing: float = 0.0              # probability (timm's RandomErasing, per-pixel noise; DeiT: 0.25)


@dataclass
class MixupConfig:
    """timm's Mixup on each batch (Zhang et al. 2018; CutMix, Yun et al. 2019); off when both alphas are 0."""
    mixup_alpha: float = 0.0                 # DeiT: 0.8
    cutmix_alpha: float = 0.0                # DeiT: 1.0
    prob: float = 1.0                        # probability of mixing a batch at all
    switch_prob: float = 0.5                 # probability of cutmix rather than mixup when both are on


@dataclass
class LossConfig:
    label_smoothing: float = 0.0             # Szegedy et al. 2016; DeiT: 0.1


@dataclass
class FinetuneModelConfig:
    drop_path_rate: float = 0.0              # stochastic depth of timm's backbones (DeiT / MAE ViT-S/B: 0.1)
    head_init_std: float = 0.01              # the new linear head: truncated normal of this std, zero bias


@dataclass
class FinetuneOptimConfig(OptimConfig):
    # Layer-wise lr decay (BEiT, Bao et al. 2022; MAE): the head keeps the lr, each layer below it gets
    # layer_decay times the lr of the layer above. Layers: ViT per block, ResNet per stage (stem, layer1..4).
    layer_decay: float = 1.0


@dataclass
class FinetuneConfig:
    name: str = "finetune"                   # the run is RUN_DIR/finetune/NAME_FRACTION_FROM_stepNNNNNNN/
    seed: int = 0
    data: FinetuneDataConfig = field(default_factory=FinetuneDataConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    mixup: MixupConfig = field(default_factory=MixupConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    model: FinetuneModelConfig = field(default_factory=FinetuneModelConfig)
    optim: FinetuneOptimConfig = field(default_factory=FinetuneOptimConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)


KEYS = tuple(schema_keys(FinetuneConfig))
KEYS_WHERE = "transfer/finetune/config.py (optim.* and engine.* in pretrain/runtime/config.py)"

# (key, low, high, what the value is): numbers that must lie in [low, high] (None: unbounded); the optim.* and
# engine.* ranges are pretraining's.
BOUNDS = (
    ("data.image_size", 1, None, "pixels"),
    ("data.eval_batch_size", 1, None, "images per evaluation forward"),
    ("augment.flip_p", 0, 1, "a probability"),
    ("augment.random_erasing", 0, 1, "a probability"),
    ("mixup.mixup_alpha", 0, None, "the Beta distribution's alpha, 0 disables mixup"),
    ("mixup.cutmix_alpha", 0, None, "the Beta distribution's alpha, 0 disables cutmix"),
    ("mixup.prob", 0, 1, "a probability"),
    ("mixup.switch_prob", 0, 1, "a probability"),
    ("model.head_init_std", 0, None, "a standard deviation"),
)


def parse_label_fraction(text: str) -> float:
    """"10%" -> 0.1, "0.1" -> 0.1; anything outside (0, 1] (or not a number) is a ConfigError."""
    text = str(text).strip()
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= 1):
        raise ConfigError(f"data.label_fraction={text!r} is not a share of the labels: give a percentage in (0%, 100%] "
                          "such as 1% or 10%, or a fraction in (0, 1] such as 0.1")
    return value


def label_fraction_name(fraction: float) -> str:
    """The fraction as it appears in file names: 0.01 -> "1pct", 0.1 -> "10pct", 1.0 -> "100pct"."""
    return f"{100 * fraction:g}pct"


def train_view_group(cfg: DictConfig, image_size: int) -> ViewGroup:
    """The loader's training view: one RandomResizedCrop + flip per image, no colour augmentation."""
    return ViewGroup(count=1, size=image_size, scale=tuple(cfg.augment.scale), ratio=tuple(cfg.augment.ratio),
                     flip_p=cfg.augment.flip_p, jitter_p=0.0, grayscale_p=0.0, blur_p=0.0, solarize_p=0.0)


def mixup_enabled(cfg: DictConfig) -> bool:
    return cfg.mixup.mixup_alpha > 0 or cfg.mixup.cutmix_alpha > 0


def load_finetune_config(path: str | Path | None, overrides: list[str] = ()) -> DictConfig:
    """Schema defaults <- YAML file <- `key=value` overrides, every key and value checked (ConfigError)."""
    tree = read_config_file(path, CONFIGS_DIR) if path is not None else {}
    cfg = merge_checked(OmegaConf.structured(FinetuneConfig), KEYS, tree, parse_overrides(list(overrides)), KEYS_WHERE)
    validate(cfg)
    return cfg


def validate(cfg: DictConfig) -> None:
    """Checks that types alone cannot express; each refusal names the key, the value and the remedy."""
    shared = ("optim.", "engine.", "data.batch_size", "data.num_workers", "data.canvas_size")
    check_choices_and_ranges(cfg, {key: allowed for key, allowed in CHOICES.items() if key.startswith(shared)},
                             tuple(row for row in NUMBER_RANGES if row[0].startswith(shared)))
    for key, low, high, meaning in BOUNDS:
        value = OmegaConf.select(cfg, key)
        if value is not None and not (math.isfinite(value) and value >= low and (high is None or value <= high)):
            bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise ConfigError(f"{key}={value} must be a finite number {bound} ({meaning})")
    check_run_name(cfg)
    parse_label_fraction(cfg.data.label_fraction)
    if cfg.data.eval_crop_fraction is not None and not 0 < cfg.data.eval_crop_fraction <= 1:
        raise ConfigError(f"data.eval_crop_fraction={cfg.data.eval_crop_fraction} must lie in (0, 1]: 0.875 for the "
                          "standard 256 -> 224 centre crop, 1.0 for the whole image")
    if not 0 <= cfg.loss.label_smoothing < 1:
        raise ConfigError(f"loss.label_smoothing={cfg.loss.label_smoothing} must lie in [0, 1) (DeiT uses 0.1)")
    if not 0 <= cfg.model.drop_path_rate < 1:
        raise ConfigError(f"model.drop_path_rate={cfg.model.drop_path_rate} must lie in [0, 1) (DeiT / MAE: 0.1)")
    if not 0 < cfg.optim.layer_decay <= 1:
        raise ConfigError(f"optim.layer_decay={cfg.optim.layer_decay} must lie in (0, 1]: 1 is no decay, BEiT / MAE "
                          "use 0.65-0.75")
    check_optim_keys(cfg)
    if cfg.optim.name == "lars" and cfg.engine.zero_stage > 0:
        raise ConfigError("optim.name=lars needs whole per-layer parameters, but ZeRO stage "
                          f"{cfg.engine.zero_stage} flattens them into partitions; use engine.zero_stage=0 "
                          "with LARS, or optim.name=sgd / adam / adamw with ZeRO")
    try:
        check_view_group(train_view_group(cfg, cfg.data.image_size or 1))
    except ValueError as error:
        raise ConfigError(str(error).replace("ViewGroup.", "augment.")) from None
    if cfg.augment.randaugment is not None:
        try:
            rand_augment_transform(cfg.augment.randaugment, {})
        except Exception as error:   # timm asserts or fails to parse: either way the string is unusable
            raise ConfigError(f"augment.randaugment={cfg.augment.randaugment!r} is not a timm RandAugment config "
                              f"string ({type(error).__name__}: {error}); e.g. rand-m9-mstd0.5-inc1 (DeiT's)") from None
    if mixup_enabled(cfg) and cfg.data.batch_size % 2:
        raise ConfigError(f"data.batch_size={cfg.data.batch_size} is odd, but timm's Mixup pairs each batch with its "
                          "reverse and needs an even batch: use an even data.batch_size or mixup / cutmix alpha 0")
