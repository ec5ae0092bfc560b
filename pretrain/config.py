"""The run configuration: a typed schema with defaults, YAML files, and dotted `key=value` overrides.

    cfg = load_config("configs/pretrain/simclr_digits.yaml", ["hvs.enabled=true", "optim.epochs=5"])

Every key is checked against the schema below; an unknown or mistyped key is an error that names the key
and the closest valid one. Values are type-checked by OmegaConf.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pretrain.config_error import ConfigError  # defined there so that the methods can raise it too; re-exported
from pretrain.data.augment import check_view_group
from pretrain.data.batch_designs import BatchDesign, check_batch_design
from pretrain.data.loader import IMAGENET_MEAN, IMAGENET_STD
from pretrain.data.views import ViewGroup


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
    # Which images form a batch: uniform (a permutation), or the class-aware p_random / group designs of
    # paper 001 (pretrain/data/batch_designs.py).
    batch_design: BatchDesign = field(default_factory=BatchDesign)


@dataclass
class ModelConfig:
    arch: str = "resnet18"                   # any timm name: resnet18, resnet50, vit_small_patch16_224, ...
    stem: str = "imagenet"                   # imagenet | small | small_stride2 (ResNets on small images)
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
    mode: str = "hard"                       # hard: train on the highest-loss combination; easy: the lowest (App. F.2)
    selection_size: Optional[int] = None     # run the selection forward at this resolution (None: full size)
    # Score at most this many candidates per step, drawn at random (without repeats) when there are more;
    # 0 means no cap: every candidate is scored (DINO with pools [2, 2, 16] and 8 locals has 51,480).
    max_candidates: int = 128


@dataclass
class OptimConfig:
    name: str = "sgd"                        # sgd | lars | adam (weight decay coupled, L2) | adamw (decoupled)
    lr: float = 0.05                         # base lr at a global batch of 256 (scaled by `lr_scaling`)
    lr_scaling: str = "linear"               # linear | sqrt | none
    # After the warm-up: cosine to min_lr, or step: the lr times lr_step_factor at each of lr_milestones
    # (fractions of training; paper 002: [0.5, 0.8] and 0.1).
    lr_schedule: str = "cosine"              # cosine | step
    lr_milestones: list[float] = field(default_factory=lambda: [0.5, 0.8])
    lr_step_factor: float = 0.1
    min_lr: float = 0.0
    warmup_epochs: float = 0.0
    epochs: int = 100
    momentum: float = 0.9
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 1e-4
    weight_decay_end: Optional[float] = None  # cosine weight-decay schedule to this value (None: constant)
    # Decay biases and normalisation parameters too; None: the method's reference (`reference_optim` of its class:
    # SimSiam, SupCon, TCL true; SimCLR, DINO false); fine-tuning: false.
    decay_norm_and_bias: Optional[bool] = None
    grad_clip: float = 0.0                   # max global gradient norm; 0 disables clipping
    grad_clip_per_parameter: float = 0.0     # max gradient norm of each parameter tensor (DINO: 3.0); 0 disables
    grad_accum: int = 1                      # micro-batches per optimizer step


@dataclass
class EngineConfig:
    zero_stage: int = 0                      # DeepSpeed ZeRO stage 0-3
    precision: str = "auto"                  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    sync_batchnorm: bool = True              # SyncBatchNorm on multi-GPU runs (never on CPU)
    channels_last: bool = False              # NHWC convolutions on GPUs (faster for ResNets in bf16; no effect on CPU)
    checkpoint_every_steps: int = 0          # 0: at the end of every epoch only
    keep_checkpoints: int = 2
    keep_exports: int = 0                    # backbone exports kept, one per checkpoint (0: all, for `eval watch`)
    log_every_steps: int = 1                 # scalars to TensorBoard / metrics.jsonl (HVS statistics every step)
    print_every_steps: int = 10              # progress line on the console
    image_grid_every_steps: int = 500        # 0 disables the grid of selected views
    max_steps: int = 0                       # stop after this many optimizer steps (0: the whole schedule)
    # A wall-clock budget: stop after this many minutes of training (0: none), counted across resumes (in the
    # checkpoint), without checkpoint writes and end-of-epoch evaluations; the run ends as a finished one.
    max_minutes: float = 0.0
    # A checkpoint (and export) every N minutes of training, in place of the epoch ends' (0: at epoch ends): the
    # evaluation marks of a time-budgeted run (`python -m launch benchmark`).
    checkpoint_every_minutes: float = 0.0
    threads: int = 0                         # CPU threads per process; 0: its share of the cores (cpu_threads.py)


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
    "model.proj_last_bn": ("none", "bn", "bn_scale"),
    "hvs.mode": ("hard", "easy"),
    "optim.name": ("sgd", "lars", "adam", "adamw"),
    "optim.lr_scaling": ("linear", "sqrt", "none"),
    "optim.lr_schedule": ("cosine", "step"),
    "engine.precision": ("auto", "bf16", "fp32"),
}


# (key, comparison, bound, what the value is): numbers outside these ranges are refused by name.
NUMBER_RANGES = (
    ("data.batch_size", ">=", 1, "images per process"),
    ("data.num_workers", ">=", 0, "loader worker processes"),
    ("data.canvas_size", ">=", 0, "pixels, or 0 for the decoded image itself"),
    ("optim.lr", ">", 0, "the peak lr at a global batch of 256"),
    ("optim.min_lr", ">=", 0, "the cosine's final lr"),
    ("optim.warmup_epochs", ">=", 0, "epochs"),
    ("optim.epochs", ">=", 1, "epochs to train"),
    ("optim.momentum", ">=", 0, "SGD / LARS momentum"),
    ("optim.weight_decay", ">=", 0, "weight decay"),
    ("optim.weight_decay_end", ">=", 0, "weight decay"),
    ("optim.grad_clip", ">=", 0, "max gradient norm, 0 disables clipping"),
    ("optim.grad_clip_per_parameter", ">=", 0, "max gradient norm of each parameter, 0 disables clipping"),
    ("optim.grad_accum", ">=", 1, "micro-batches per optimizer step"),
    ("engine.checkpoint_every_steps", ">=", 0, "0: at epoch ends only"),
    ("engine.keep_checkpoints", ">=", 0, "0: keep all"),
    ("engine.keep_exports", ">=", 0, "0: keep all"),
    ("engine.log_every_steps", ">=", 1, "steps"),
    ("engine.print_every_steps", ">=", 1, "steps"),
    ("engine.image_grid_every_steps", ">=", 0, "0 disables the grid"),
    ("engine.max_steps", ">=", 0, "0: the whole schedule"),
    ("engine.max_minutes", ">=", 0, "minutes of training, 0: no time budget"),
    ("engine.checkpoint_every_minutes", ">=", 0, "minutes of training, 0: at epoch ends"),
    ("engine.threads", ">=", 0, "CPU threads per process, 0: the process's share of the cores"),
    ("hvs.selection_size", ">=", 1, "pixels"),
    ("monitor.online_probe_lr", ">", 0, "the online probe's Adam lr"),
    ("seed", ">=", 0, "the random seed"),
)


def check_architecture(arch: str) -> None:
    """Refuse a model.arch that timm does not know, naming the closest names it does."""
    import timm

    if timm.is_model(arch):
        return
    close = difflib.get_close_matches(arch, timm.list_models(), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else "; e.g. resnet18, resnet50, vit_small_patch16_224"
    raise ConfigError(f"model.arch={arch!r} is not a timm model name{hint} (`timm.list_models()` lists them all)")


def schema_keys(schema: type, prefix: str = "") -> list[str]:
    """All dotted key paths of a dataclass schema (list items as `views.N.size`)."""
    keys, defaults = [], schema()
    for f in fields(schema):
        path = f"{prefix}{f.name}"
        keys.append(path)
        default = getattr(defaults, f.name)
        if is_dataclass(default):
            keys += schema_keys(type(default), path + ".")
        elif isinstance(default, list) and default and is_dataclass(default[0]):
            keys += schema_keys(type(default[0]), path + ".N.")
    return keys


SCHEMA_KEYS = tuple(schema_keys(Config))   # without method.*: those depend on method.name
# Where an unknown-key message sends the user (other schemas, e.g. transfer's, pass their own).
PRETRAIN_KEYS_WHERE = "pretrain/config.py, and method.* in the method's Options in pretrain/methods/"
DEFAULT_METHOD = "simclr"


def method_options(name: str) -> type:
    """The `Options` dataclass (the `method.*` keys) of method `name`."""
    from pretrain.methods import available_methods, method_module

    module = method_module(name)
    if module is None:
        raise ConfigError(f"method.name={name!r} is not one of {tuple(available_methods())} "
                          "(one file each in pretrain/methods/)")
    return module.Options


def _check_key(path: str, keys: tuple[str, ...], where: str = PRETRAIN_KEYS_WHERE) -> None:
    generic = ".".join("N" if part.isdigit() else part for part in path.split("."))
    if generic in keys:
        return
    close = difflib.get_close_matches(generic, keys, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0].replace('.N.', '.0.')!r}?" if close else ""
    raise ConfigError(f"unknown config key {path!r}{hint} (valid keys are listed in {where})")


def _check_tree(tree: dict, keys: tuple[str, ...], prefix: str = "", where: str = PRETRAIN_KEYS_WHERE) -> None:
    for key, value in tree.items():
        path = f"{prefix}{key}"
        _check_key(path, keys, where)
        if isinstance(value, dict):
            _check_tree(value, keys, path + ".", where)
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for i, item in enumerate(value):
                _check_tree(item, keys, f"{path}.{i}.", where)


def parse_overrides(overrides: list[str]) -> list[tuple[str, object]]:
    """`key=value` strings -> (key, value parsed as YAML) pairs; a malformed one is a ConfigError."""
    parsed = []
    for override in overrides:
        if "=" not in override:
            raise ConfigError(f"override {override!r} is not of the form key=value (e.g. hvs.enabled=true)")
        key, text = override.split("=", 1)
        try:
            parsed.append((key, yaml.safe_load(text)))
        except yaml.YAMLError:
            raise ConfigError(f"the value of override {override!r} is not valid YAML; quote it, e.g. "
                              f"{key}='{text}'") from None
    return parsed


def load_config(path: str | Path | None, overrides: list[str] = ()) -> DictConfig:
    """Schema defaults <- YAML file <- `key=value` overrides (values parsed as YAML: 5, 0.1, true, [1, 2]).

    The method is chosen first (`method.name` from the overrides, else the file, else simclr), because
    its `Options` define which `method.*` keys exist; `model.*` keys still None then take its reference's values.
    """
    tree = read_config_file(path) if path is not None else {}
    parsed = parse_overrides(list(overrides))
    name = (tree.get("method") or {}).get("name", DEFAULT_METHOD)
    name = next((value for key, value in reversed(parsed) if key == "method.name"), name)
    options = method_options(str(name))
    keys = SCHEMA_KEYS + tuple(schema_keys(options, "method."))
    cfg = OmegaConf.structured(Config)
    cfg.method = OmegaConf.structured(options)
    cfg = merge_checked(cfg, keys, tree, parsed)
    fill_reference_values(cfg)
    validate(cfg)
    return cfg


def fill_reference_values(cfg: DictConfig) -> None:
    """The `model.*` and `optim.*` keys left at None take the value of the method's reference
    (`Method.reference_model`, `Method.reference_optim`), so that RUN_DIR/config.yaml and the export record what was
    built."""
    from pretrain.methods import method_module

    method = method_module(cfg.method.name).METHOD
    for section, values in (("model", method.reference_model), ("optim", method.reference_optim)):
        for key, value in values.items():
            if cfg[section][key] is None:
                cfg[section][key] = value


def read_config_file(path: str | Path, configs_dir: str = "configs/pretrain/") -> dict:
    """The mapping in the YAML file `path`; a missing file, bad YAML or a non-mapping is a ConfigError that
    names the file (and `configs_dir`, where the shipped configs live)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory; pass one of its .yaml files (configs live in "
                          f"{configs_dir})")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; configs live in {configs_dir}")
    try:
        tree = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        line = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"config file {str(path)!r} is not valid YAML{line}: {problem}") from None
    if tree is None:      # an empty file (or comments only) would run on the built-in defaults, silently
        raise ConfigError(f"config file {str(path)!r} is empty; a config is a mapping of sections (name:, data:, "
                          f"...), as in {configs_dir}")
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {str(path)!r} holds a {type(tree).__name__} at its top level; a config is "
                          f"a mapping of sections (name:, data:, ...), as in {configs_dir}")
    return tree


def merge_checked(cfg: DictConfig, keys: tuple[str, ...], tree: dict, parsed: list[tuple[str, object]],
                  where: str = PRETRAIN_KEYS_WHERE) -> DictConfig:
    """Schema `cfg` <- file `tree` <- `parsed` overrides, every key checked against `keys` (an unknown key
    names the closest valid one and `where` the keys are listed); type errors become ConfigErrors."""
    try:
        _check_tree(tree, keys, where=where)
        cfg = OmegaConf.merge(cfg, tree)
        for key, value in parsed:
            _check_key(key, keys, where)
            check_list_indices(cfg, key)
            node = OmegaConf.select(cfg, key)
            if isinstance(node, ListConfig) and not isinstance(value, list):
                raise ConfigError(f"{key} is a list; write {key}=[{value}]")
            # A list is replaced whole; merging it converts its items to the schema's types (data.views=[{...}]).
            OmegaConf.update(cfg, key, value, merge=isinstance(node, ListConfig))
    except OmegaConfBaseException as error:          # one line: the key and OmegaConf's reason, not its dump
        key = getattr(error, "full_key", None) or "config"
        reason = (getattr(error, "msg", None) or str(error)).splitlines()[0]
        if "is not Optional" in reason:
            reason = f"it needs a value ({key}= gives none)"
        raise ConfigError(f"invalid value for {key}: {reason}") from None
    return cfg


def check_list_indices(cfg: DictConfig, key: str) -> None:
    """Refuse a dotted key that indexes past the end of a list (data.views.3.size with one view group)."""
    parts = key.split(".")
    for index, part in enumerate(parts):
        if part.isdigit():
            prefix = ".".join(parts[:index])
            node = OmegaConf.select(cfg, prefix)
            if isinstance(node, ListConfig) and int(part) >= len(node):
                raise ConfigError(f"{key}: {prefix} has {len(node)} item(s), numbered from 0; set an existing one "
                                  f"({prefix}.0...), or give the whole list as {prefix}=[...]")


def check_choices_and_ranges(cfg: DictConfig, choices: dict[str, tuple], ranges: tuple) -> None:
    """Refuse, by key and value, a value outside `choices`, a ZeRO stage outside 0-3, or a number outside
    `ranges` ((key, comparison, bound, meaning) rows as NUMBER_RANGES; None values pass)."""
    for key, allowed in choices.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {allowed}")
    if not 0 <= cfg.engine.zero_stage <= 3:
        raise ConfigError(f"engine.zero_stage={cfg.engine.zero_stage} must be 0, 1, 2 or 3")
    for key, comparison, bound, meaning in ranges:
        value = OmegaConf.select(cfg, key)
        if value is None:
            continue
        if not math.isfinite(value) or value < bound or (comparison == ">" and value == bound):
            raise ConfigError(f"{key}={value} must be a finite number {comparison} {bound} ({meaning})")


def check_optim_keys(cfg: DictConfig) -> None:
    """The optim.* keys that ranges alone cannot check (pretraining and fine-tuning): the lr schedule, Adam's betas."""
    o = cfg.optim
    betas = list(o.betas)
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
        raise ConfigError(f"optim.betas={betas} must be two numbers in [0, 1): Adam's decay rates of the gradient's "
                          "mean and of its square, e.g. [0.9, 0.999]")
    if o.min_lr > o.lr:
        raise ConfigError(f"optim.min_lr={o.min_lr} is above optim.lr={o.lr}: the cosine decays from optim.lr to "
                          "min_lr")
    if o.lr_schedule != "step":
        return
    milestones = list(o.lr_milestones)
    if not milestones or any(not 0 < m < 1 for m in milestones) or milestones != sorted(set(milestones)):
        raise ConfigError(f"optim.lr_milestones={milestones} must be increasing fractions of training in (0, 1), "
                          "e.g. [0.5, 0.8] (the lr steps down at 50% and 80% of the steps)")
    if not 0 < o.lr_step_factor <= 1:
        raise ConfigError(f"optim.lr_step_factor={o.lr_step_factor} must lie in (0, 1]: the lr is multiplied by it at "
                          "every milestone (0.1 divides it by 10)")
    if o.min_lr != 0:
        raise ConfigError(f"optim.min_lr={o.min_lr} is the cosine's final lr, which optim.lr_schedule=step does not "
                          "use (it ends at lr x lr_step_factor ** len(lr_milestones)); set optim.min_lr=0, or "
                          "optim.lr_schedule=cosine")


def check_run_name(cfg: DictConfig) -> None:
    """`name` becomes the folder runs/NAME (when run_dir is not given): one folder name, not a path, not empty (an
    empty name would train into runs/ itself, among every other run)."""
    name = str(cfg.name)
    if not name.strip() or name.strip() in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ConfigError(f"name={name!r} must be a folder name (letters, digits, '_', '-', '.'), not empty and "
                          "without '/': the run trains into runs/NAME; to choose the folder itself, set run_dir=PATH")
    run_dir = cfg.get("run_dir")
    if run_dir is not None and not str(run_dir).strip():
        raise ConfigError(f"run_dir={run_dir!r} is empty: give a folder, or leave run_dir out for runs/NAME")


def validate(cfg: DictConfig) -> None:
    """Checks that types alone cannot express (and the method's own, `METHOD.check_config`)."""
    from pretrain.methods import method_module

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
