"""The run configuration: a typed schema with defaults, YAML files, and dotted `key=value` overrides.

    cfg = load_config("configs/pretrain/simclr_digits.yaml", ["hvs.enabled=true", "optim.epochs=5"])

Every key is checked against the schema below; an unknown or mistyped key is an error that names the key
and the closest valid one. Values are type-checked by OmegaConf.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from pretrain.data.augment import check_view_group
from pretrain.data.batch_designs import BatchDesign, check_batch_design
from pretrain.data.loader import IMAGENET_MEAN, IMAGENET_STD
from pretrain.data.views import ViewGroup
from pretrain.methods import available_methods, method_module
from pretrain.runtime.config import (RUNTIME_CHOICES, RUNTIME_RANGES, EngineConfig, OptimConfig,
                                     check_choices_and_ranges, check_optim_keys, check_run_name, merge_checked,
                                     parse_overrides, read_config_file, schema_keys)
from pretrain.runtime.config_error import ConfigError  # defined there so that the methods can raise it too; re-exported


@dataclass
class DataConfig:
    train: str = "data/digits/train.beton"   # .beton written by `python -m pretrain.data`
    val: str = "data/digits/val.beton"       # held-out split for k-NN / linear evaluation
    backend: str = "ffcv"                    # ffcv | torchvision (torchvision reads an image folder)
    batch_size: int = 256                    # per process (micro-batch); global = this x processes x grad_accum
    num_workers: int = 2
    canvas_size: int = 32                    # side of the decoded image that views are cropped from; 0: the image as decoded
    mean: list[float] = field(default_factory=lambda: list(IMAGENET_MEAN))
    std: list[float] = field(default_factory=lambda: list(IMAGENET_STD))
    views: list[ViewGroup] = field(default_factory=lambda: [ViewGroup()])
    # Evaluation input (k-NN, linear probe, transfer): the shorter side resized to size / eval_crop_fraction,
    # then a centre crop of `size` px (0.875: the standard 256 -> 224). 1.0 keeps the whole of a square image
    # (the digits, CIFAR-sized folders).
    eval_crop_fraction: float = 0.875
    # The evaluation's image side in pixels; 0: the first view group's size. A network trained on random-resized
    # crops sees objects larger than in a whole image of the same side, so it may score better at a larger side
    # (Touvron et al. 2019, "Fixing the train-test resolution discrepancy").
    eval_image_size: int = 0
    # Which images form a batch: uniform (a permutation), or the class-aware p_random / group designs of
    # paper 001 (pretrain/data/batch_designs.py).
    batch_design: BatchDesign = field(default_factory=BatchDesign)


@dataclass
class ModelConfig:
    arch: str = "resnet18"                   # any timm name: resnet18, resnet50, vit_small_patch16_224, ...
    stem: str = "imagenet"                   # imagenet | small | small_stride2 (ResNets on small images)
    # A small stem's convolution starts as nn.Conv2d's default (torch) or Kaiming-normal fan-out (kaiming_fan_out:
    # timm's and torchvision's other convolutions, SupContrast's CIFAR stem)
    stem_init: str = "torch"
    # A ViT's position embedding for inputs of another size and its class token's start: timm (antialiased bicubic;
    # std 1e-6) or dino (DINO's interpolate_pos_encoding, plain bicubic at (n + 0.1) / N; trunc-normal 0.02)
    vit_pos_embed: str = "timm"
    # None (the default of these two): the value of the method's reference, `reference_model` of its class in
    # pretrain/methods/NAME.py (SimCLR, SimSiam: zero-init true; DINO, SupCon, TCL: false), filled in by load_config.
    zero_init_residual: Optional[bool] = None  # ResNets: last BN of each residual branch starts at 0
    proj_hidden_bn: Optional[bool] = None    # projector's hidden layers Linear(no bias)-BN-ReLU, or Linear-ReLU (false)
    proj_hidden_dim: int = 2048
    proj_out_dim: int = 128
    proj_layers: int = 2
    # A BatchNorm after the projector's last linear layer: none | bn (no affine) | bn_scale (a scale, no shift:
    # google-research/simclr). SimSiam's projector always ends with `bn`, as facebookresearch/simsiam.
    proj_last_bn: str = "none"
    pred_hidden_dim: int = 512               # SimSiam predictor bottleneck


@dataclass
class HVSConfig:
    enabled: bool = False
    # Views drawn per image, one entry per data.views group (the pool); every combination that takes each
    # group's `count` views from its pool is a candidate. SimCLR: [4] gives the 6 pairs of 4 views.
    num_views: list[int] = field(default_factory=lambda: [4])
    # hard: train on the highest-loss combination; easy: the lowest (App. F.2); all: no scoring, the loss averaged
    # over every combination, back-propagated through all of them (SimCLR, SimSiam: pretrain/methods/base.py)
    mode: str = "hard"
    selection_size: Optional[int] = None     # run the selection forward at this resolution (None: full size)
    # Score at most this many candidates per step, drawn at random (without repeats) when there are more;
    # 0 means no cap: every candidate is scored (DINO with pools [2, 2, 16] and 8 locals has 51,480).
    max_candidates: int = 128


@dataclass
class MonitorConfig:
    # What the run logs about its representation while it trains (pretrain/online_monitors.py)
    rankme: bool = True                      # monitor/rankme: effective rank of the batch's backbone features
    online_probe: bool = True                # monitor/online_linear_top1: a linear probe on detached features
    online_probe_lr: float = 1.0e-3          # the probe's Adam lr


@dataclass
class Config:
    name: str = "run"
    run_dir: Optional[str] = None            # default: runs/NAME
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    # The `method.*` keys are the `Options` dataclass of pretrain/methods/NAME.py for method.name=NAME.
    method: Any = None
    hvs: HVSConfig = field(default_factory=HVSConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)


CHOICES = {
    "data.backend": ("ffcv", "torchvision"),
    "model.stem": ("imagenet", "small", "small_stride2"),
    "model.stem_init": ("torch", "kaiming_fan_out"),
    "model.vit_pos_embed": ("timm", "dino"),
    "model.proj_last_bn": ("none", "bn", "bn_scale"),
    "hvs.mode": ("hard", "easy", "all"),
    **RUNTIME_CHOICES,
}


# (key, comparison, bound, what the value is): numbers outside these ranges are refused by name.
NUMBER_RANGES = (
    ("data.batch_size", ">=", 1, "images per process"),
    ("data.num_workers", ">=", 0, "loader worker processes"),
    ("data.canvas_size", ">=", 0, "pixels, or 0 for the decoded image itself"),
    ("data.eval_image_size", ">=", 0, "pixels, or 0 for the first view group's size"),
    *RUNTIME_RANGES,
    ("hvs.selection_size", ">=", 1, "pixels"),
    ("monitor.online_probe_lr", ">", 0, "the online probe's Adam lr"),
    ("seed", ">=", 0, "the random seed"),
)


def check_architecture(arch: str) -> None:
    """Refuse a model.arch that timm does not know, naming the closest names it does."""
    import timm  # heavy: timm and torchvision (~1.8 s), which `python -m pretrain --help` does not need

    if timm.is_model(arch):
        return
    close = difflib.get_close_matches(arch, timm.list_models(), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else "; e.g. resnet18, resnet50, vit_small_patch16_224"
    raise ConfigError(f"model.arch={arch!r} is not a timm model name{hint} (`timm.list_models()` lists them all)")


SCHEMA_KEYS = tuple(schema_keys(Config))   # without method.*: those depend on method.name
# Where an unknown-key message sends the user (other schemas, e.g. transfer's, pass their own).
PRETRAIN_KEYS_WHERE = ("pretrain/config.py (optim.* and engine.* in pretrain/runtime/config.py), and method.* in "
                       "the method's Options in pretrain/methods/")
DEFAULT_METHOD = "simclr"


def method_options(name: str) -> type:
    """The `Options` dataclass (the `method.*` keys) of method `name`."""
    module = method_module(name)
    if module is None:
        raise ConfigError(f"method.name={name!r} is not one of {tuple(available_methods())} "
                          "(one file each in pretrain/methods/)")
    return module.Options


def load_config(path: str | Path | None, overrides: list[str] = ()) -> DictConfig:
    """Schema defaults <- YAML file <- `key=value` overrides (values parsed as YAML: 5, 0.1, true, [1, 2]).

    The method is chosen first (`method.name` from the overrides, else the file, else simclr), because
    its `Options` define which `method.*` keys exist; `model.*` keys still None then take its reference's values.
    """
    tree = read_config_file(path, "configs/pretrain/") if path is not None else {}
    parsed = parse_overrides(list(overrides))
    name = (tree.get("method") or {}).get("name", DEFAULT_METHOD)
    name = next((value for key, value in reversed(parsed) if key == "method.name"), name)
    options = method_options(str(name))
    keys = SCHEMA_KEYS + tuple(schema_keys(options, "method."))
    cfg = OmegaConf.structured(Config)
    cfg.method = OmegaConf.structured(options)
    cfg = merge_checked(cfg, keys, tree, parsed, PRETRAIN_KEYS_WHERE)
    fill_reference_values(cfg)
    validate(cfg)
    return cfg


def fill_reference_values(cfg: DictConfig) -> None:
    """The `model.*` and `optim.*` keys left at None take the value of the method's reference
    (`Method.reference_model`, `Method.reference_optim`), so that RUN_DIR/config.yaml and the export record what was
    built."""
    method = method_module(cfg.method.name).METHOD
    for section, values in (("model", method.reference_model), ("optim", method.reference_optim)):
        for key, value in values.items():
            if cfg[section][key] is None:
                cfg[section][key] = value


def validate(cfg: DictConfig) -> None:
    """Checks that types alone cannot express (and the method's own, `METHOD.check_config`)."""
    check_run_name(cfg)
    check_choices_and_ranges(cfg, CHOICES, NUMBER_RANGES)
    if not 0 < cfg.data.eval_crop_fraction <= 1:
        raise ConfigError(f"data.eval_crop_fraction={cfg.data.eval_crop_fraction} must lie in (0, 1]: 0.875 for "
                          "the standard 256 -> 224 centre crop, 1.0 for the whole image")
    check_optim_keys(cfg)
    for key in ("mean", "std"):
        values = list(cfg.data[key])
        if len(values) != 3 or not all(math.isfinite(v) for v in values):
            raise ConfigError(f"data.{key}={values} must be 3 finite numbers, one per channel (R, G, B)")
    if min(cfg.data.std) <= 0:
        raise ConfigError(f"data.std={list(cfg.data.std)} must be positive in every channel (images are divided "
                          "by it)")
    for key, value in cfg.method.items():
        if (key == "temperature" or key.endswith("_temp")) and isinstance(value, (int, float)) and not value > 0:
            raise ConfigError(f"method.{key}={value} must be positive (a temperature: the logits are divided by it)")
    for index, group in enumerate(views_to_draw(cfg)):
        try:
            check_view_group(group)
        except ValueError as error:
            raise ConfigError(f"data.views.{index}: {error}") from None
    try:
        check_batch_design(BatchDesign(**cfg.data.batch_design))
    except ValueError as error:
        raise ConfigError(f"data.batch_design.{error}") from None
    check_architecture(cfg.model.arch)
    if cfg.optim.name == "lars" and cfg.engine.zero_stage > 0:
        raise ConfigError("optim.name=lars needs whole per-layer parameters, but ZeRO stage "
                          f"{cfg.engine.zero_stage} flattens them into partitions; use engine.zero_stage=0 "
                          "with LARS, or optim.name=sgd / adam / adamw with ZeRO")
    if not cfg.data.views or any(group.count < 1 for group in cfg.data.views):
        raise ConfigError("data.views needs at least one view group, each with count >= 1")
    method_module(cfg.method.name).METHOD.check_config(cfg)
    if cfg.hvs.enabled:
        pool, counts = list(cfg.hvs.num_views), [group.count for group in cfg.data.views]
        if len(pool) != len(counts) or any(n < c for n, c in zip(pool, counts)):
            raise ConfigError(f"hvs.num_views={pool} must give, for each of the {len(counts)} data.views groups, "
                              f"a pool at least as large as its count {counts}")
        if all(n == c for n, c in zip(pool, counts)):
            raise ConfigError(f"hvs.num_views={pool} equals the views trained on {counts}, which leaves one "
                              "combination to choose from; draw more views (the paper uses 4 for pairs)")
        method = method_module(cfg.method.name).METHOD
        if cfg.hvs.mode == "all" and not method.trains_on_every_combination():
            raise ConfigError(f"hvs.mode=all averages the per-sample loss over every combination, but "
                              f"method.name={cfg.method.name}'s training loss is more than that mean (its loss() keeps "
                              "state or differs from its scoring): use hvs.mode=all with simclr or simsiam, or "
                              "hvs.mode=hard / easy with this method")
        if cfg.hvs.max_candidates < 0:
            raise ConfigError(f"hvs.max_candidates={cfg.hvs.max_candidates} must be >= 0 (0: no cap)")


def views_to_draw(cfg: DictConfig) -> list[ViewGroup]:
    """The view groups the loader draws: with hard view selection, each group's pool (hvs.num_views)."""
    groups = [ViewGroup(**{key: tuple(value) if isinstance(value, list) else value
                           for key, value in OmegaConf.to_container(group).items()})
              for group in cfg.data.views]
    if cfg.hvs.enabled:
        for group, pool in zip(groups, cfg.hvs.num_views):
            group.count = pool
    return groups


def run_dir_of(cfg: DictConfig) -> Path:
    return Path(cfg.run_dir) if cfg.run_dir else Path("runs") / cfg.name
