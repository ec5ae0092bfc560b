"""The run configuration: a typed schema with defaults, YAML files, and dotted `key=value` overrides.

    cfg = load_config("configs/pretrain/simclr_digits.yaml", ["hvs.enabled=true", "optim.epochs=5"])

Every key is checked against the schema below; an unknown or mistyped key is an error that names the key
and the closest valid one. Values are type-checked by OmegaConf.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pretrain.data.loader import IMAGENET_MEAN, IMAGENET_STD
from pretrain.data.views import ViewGroup


@dataclass
class DataConfig:
    train: str = "data/digits/train.beton"   # .beton written by `python -m pretrain.data`
    val: str = "data/digits/val.beton"       # held-out split for k-NN / linear evaluation
    backend: str = "ffcv"                    # ffcv | torchvision (torchvision reads an image folder)
    batch_size: int = 256                    # per process (micro-batch); global = this x processes x grad_accum
    num_workers: int = 2
    canvas_size: int = 32                    # side of the decoded image that views are cropped from
    mean: list[float] = field(default_factory=lambda: list(IMAGENET_MEAN))
    std: list[float] = field(default_factory=lambda: list(IMAGENET_STD))
    views: list[ViewGroup] = field(default_factory=lambda: [ViewGroup()])


@dataclass
class ModelConfig:
    arch: str = "resnet18"                   # any timm name: resnet18, resnet50, vit_small_patch16_224, ...
    stem: str = "imagenet"                   # imagenet | small | small_stride2 (ResNets on small images)
    zero_init_residual: bool = False         # ResNets: last BN of each residual branch starts at 0
    proj_hidden_dim: int = 2048
    proj_out_dim: int = 128
    proj_layers: int = 2
    pred_hidden_dim: int = 512               # SimSiam predictor bottleneck


@dataclass
class MethodConfig:
    name: str = "simclr"                     # simclr | simsiam
    temperature: float = 0.2                 # SimCLR NT-Xent temperature
    gather_negatives: bool = True            # SimCLR: negatives from every process, not only the local batch
    fix_pred_lr: bool = True                 # SimSiam: predictor keeps the base lr (no cosine decay)


@dataclass
class HVSConfig:
    enabled: bool = False
    num_views: int = 4                       # N views drawn per image; N(N-1)/2 pairs are scored
    mode: str = "hard"                       # hard: train on the highest-loss pair; easy: the lowest (App. F.2)
    selection_size: Optional[int] = None     # run the selection forward at this resolution (None: full size)


@dataclass
class OptimConfig:
    name: str = "sgd"                        # sgd | lars | adamw
    lr: float = 0.05                         # base lr at a global batch of 256 (scaled by `lr_scaling`)
    lr_scaling: str = "linear"               # linear | sqrt | none
    min_lr: float = 0.0
    warmup_epochs: float = 0.0
    epochs: int = 100
    momentum: float = 0.9
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 1e-4
    weight_decay_end: Optional[float] = None  # cosine weight-decay schedule to this value (None: constant)
    grad_clip: float = 0.0                   # max gradient norm; 0 disables clipping
    grad_accum: int = 1                      # micro-batches per optimizer step


@dataclass
class EngineConfig:
    zero_stage: int = 0                      # DeepSpeed ZeRO stage 0-3
    precision: str = "auto"                  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    sync_batchnorm: bool = True              # SyncBatchNorm on multi-GPU runs (never on CPU)
    checkpoint_every_steps: int = 0          # 0: at the end of every epoch only
    keep_checkpoints: int = 2
    log_every_steps: int = 1                 # scalars to TensorBoard / metrics.jsonl (HVS statistics every step)
    print_every_steps: int = 10              # progress line on the console
    image_grid_every_steps: int = 500        # 0 disables the grid of selected views
    max_steps: int = 0                       # stop after this many optimizer steps (0: the whole schedule)


@dataclass
class Config:
    name: str = "run"
    run_dir: Optional[str] = None            # default: runs/NAME
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    hvs: HVSConfig = field(default_factory=HVSConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)


CHOICES = {
    "data.backend": ("ffcv", "torchvision"),
    "model.stem": ("imagenet", "small", "small_stride2"),
    "method.name": ("simclr", "simsiam"),
    "hvs.mode": ("hard", "easy"),
    "optim.name": ("sgd", "lars", "adamw"),
    "optim.lr_scaling": ("linear", "sqrt", "none"),
    "engine.precision": ("auto", "bf16", "fp32"),
}


class ConfigError(ValueError):
    """A configuration the user must fix; the message says what and how."""


def _schema_keys(schema: type, prefix: str = "") -> list[str]:
    """All dotted key paths of a dataclass schema (list items as `views.N.size`)."""
    keys, defaults = [], schema()
    for f in fields(schema):
        path = f"{prefix}{f.name}"
        keys.append(path)
        default = getattr(defaults, f.name)
        if is_dataclass(default):
            keys += _schema_keys(type(default), path + ".")
        elif isinstance(default, list) and default and is_dataclass(default[0]):
            keys += _schema_keys(type(default[0]), path + ".N.")
    return keys


SCHEMA_KEYS = tuple(_schema_keys(Config))


def _check_key(path: str) -> None:
    generic = ".".join("N" if part.isdigit() else part for part in path.split("."))
    if generic in SCHEMA_KEYS:
        return
    close = difflib.get_close_matches(generic, SCHEMA_KEYS, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0].replace('.N.', '.0.')!r}?" if close else ""
    raise ConfigError(f"unknown config key {path!r}{hint} (valid keys are listed in pretrain/config.py)")


def _check_tree(tree: dict, prefix: str = "") -> None:
    for key, value in tree.items():
        path = f"{prefix}{key}"
        _check_key(path)
        if isinstance(value, dict):
            _check_tree(value, path + ".")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for i, item in enumerate(value):
                _check_tree(item, f"{path}.{i}.")


def load_config(path: str | Path | None, overrides: list[str] = ()) -> DictConfig:
    """Schema defaults <- YAML file <- `key=value` overrides (values parsed as YAML: 5, 0.1, true, [1, 2])."""
    cfg = OmegaConf.structured(Config)
    try:
        if path is not None:
            path = Path(path)
            if not path.is_file():
                raise ConfigError(f"config file {str(path)!r} does not exist; configs live in configs/pretrain/")
            tree = yaml.safe_load(path.read_text()) or {}
            _check_tree(tree)
            cfg = OmegaConf.merge(cfg, tree)
        for override in overrides:
            if "=" not in override:
                raise ConfigError(f"override {override!r} is not of the form key=value (e.g. hvs.enabled=true)")
            key, text = override.split("=", 1)
            _check_key(key)
            OmegaConf.update(cfg, key, yaml.safe_load(text), merge=False)
    except OmegaConfBaseException as error:
        raise ConfigError(f"invalid config value: {error}") from None
    validate(cfg)
    return cfg


def validate(cfg: DictConfig) -> None:
    """Checks that types alone cannot express."""
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {allowed}")
    if cfg.hvs.enabled and cfg.hvs.num_views < 3:
        raise ConfigError(f"hvs.num_views={cfg.hvs.num_views}: hard view selection needs at least 3 views "
                          "to choose a pair from (the paper uses 4)")
    if not 0 <= cfg.engine.zero_stage <= 3:
        raise ConfigError(f"engine.zero_stage={cfg.engine.zero_stage} must be 0, 1, 2 or 3")
    if cfg.optim.grad_accum < 1 or cfg.data.batch_size < 1:
        raise ConfigError("optim.grad_accum and data.batch_size must be at least 1")
    if cfg.optim.name == "lars" and cfg.engine.zero_stage > 0:
        raise ConfigError("optim.name=lars needs whole per-layer parameters, but ZeRO stage "
                          f"{cfg.engine.zero_stage} flattens them into partitions; use engine.zero_stage=0 "
                          "with LARS, or optim.name=sgd / adamw with ZeRO")
    if len(cfg.data.views) != 1:
        raise ConfigError(f"{cfg.method.name} trains on one view group; data.views has {len(cfg.data.views)}")


def views_to_draw(cfg: DictConfig) -> list[ViewGroup]:
    """The view groups the loader draws: with hard view selection the pair group becomes N views."""
    groups = [ViewGroup(**{key: tuple(value) if isinstance(value, list) else value
                           for key, value in OmegaConf.to_container(group).items()})
              for group in cfg.data.views]
    if cfg.hvs.enabled:
        groups[0].count = cfg.hvs.num_views
    return groups


def run_dir_of(cfg: DictConfig) -> Path:
    return Path(cfg.run_dir) if cfg.run_dir else Path("runs") / cfg.name
