"""The configuration machinery every stage shares, and the `optim.*` / `engine.*` sections the training loop reads.

A stage's config is a dataclass schema (pretraining's `pretrain/config.py`, fine-tuning's
`transfer/finetune/config.py`, detection's) merged with a YAML file and dotted `key=value` overrides:

    tree = read_config_file(path, "configs/pretrain/")
    cfg = merge_checked(OmegaConf.structured(Schema), tuple(schema_keys(Schema)), tree, parse_overrides(overrides),
                        where="pretrain/config.py")

Every key is checked against the schema (an unknown key names the closest valid one and where the keys are
listed); values are type-checked by OmegaConf, then against choices and ranges (`check_choices_and_ranges`).
`OptimConfig` and `EngineConfig` are the sections of a `ConfiguredStage` (pretrain/runtime/loop.py): the
optimizer, its schedules (their length: optim.epochs or a compute budget), DeepSpeed, checkpoints, logging and the
time budget.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Optional

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf, TupleConfig
from omegaconf.errors import OmegaConfBaseException

from pretrain.runtime.config_error import ConfigError


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
    # A compute budget in PFLOP (1e15 floating-point operations, as FlopCounterMode counts them), in place of
    # `epochs`: every schedule spans the optimizer steps it buys, floor(budget / the FLOPs counted for one step), and
    # the run ends there (pretrain/runtime/compute_budget.py). 0: the schedules span `epochs`.
    budget_pflop: float = 0.0
    # With a time budget (engine.max_minutes), size every schedule from a step time measured at the start instead of
    # `epochs`: the optimizer steps that fit in the minutes (pretrain/runtime/compute_budget.py: `timed_step_seconds`).
    # The machine's speed moves during a run, so the run may still end short of its schedule or of its minutes;
    # `launch benchmark` flags either below 95%.
    schedule_from_minutes: bool = False
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
    log_every_steps: int = 10                # scalars to TensorBoard / metrics.jsonl (and the monitors computed)
    print_every_steps: int = 10              # progress line on the console
    image_grid_every_steps: int = 500        # 0 disables the grid of selected views
    max_steps: int = 0                       # stop after this many optimizer steps (0: the whole schedule)
    # A wall-clock budget: stop after this many minutes of training (0: none), counted across resumes (in the
    # checkpoint), without checkpoint writes and end-of-epoch evaluations; the run ends as a finished one.
    max_minutes: float = 0.0
    # A checkpoint (and export) every N minutes of training, in place of the epoch ends' (0: at epoch ends): the
    # evaluation marks of a time-budgeted run (`python -m launch benchmark`).
    checkpoint_every_minutes: float = 0.0
    # N checkpoints (and exports) evenly spaced over the run's steps, the last at its last step, in place of the epoch
    # ends' (0: at epoch ends): the evaluation marks of a run whose steps are known only once it has started (a
    # compute budget's, `python -m launch benchmark`).
    checkpoints_per_run: int = 0
    threads: int = 0                         # CPU threads per process; 0: its share of the cores (cpu_threads.py)


# The choices and ranges of the optim.* and engine.* keys; a stage's own tables add its sections' (pretraining's
# CHOICES and NUMBER_RANGES in pretrain/config.py).
RUNTIME_CHOICES = {
    "optim.name": ("sgd", "lars", "adam", "adamw"),
    "optim.lr_scaling": ("linear", "sqrt", "none"),
    "optim.lr_schedule": ("cosine", "step"),
    "engine.precision": ("auto", "bf16", "fp32"),
}

# (key, comparison, bound, what the value is): numbers outside these ranges are refused by name.
RUNTIME_RANGES = (
    ("optim.lr", ">", 0, "the peak lr at a global batch of 256"),
    ("optim.min_lr", ">=", 0, "the cosine's final lr"),
    ("optim.warmup_epochs", ">=", 0, "epochs"),
    ("optim.epochs", ">=", 1, "epochs to train"),
    ("optim.budget_pflop", ">=", 0, "the compute budget in PFLOP, 0: the schedules span optim.epochs"),
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
    ("engine.checkpoints_per_run", ">=", 0, "checkpoints evenly spaced over the run, 0: at epoch ends"),
    ("engine.threads", ">=", 0, "CPU threads per process, 0: the process's share of the cores"),
)


def schema_keys(schema: type, prefix: str = "") -> list[str]:
    """All dotted key paths of a dataclass schema (list items as `views.N.size`, a list of numbers' items as
    `views.N.scale.N`: one crop bound is a key a search can move)."""
    keys, defaults = [], schema()
    for f in fields(schema):
        path = f"{prefix}{f.name}"
        keys.append(path)
        default = getattr(defaults, f.name)
        if is_dataclass(default):
            keys += schema_keys(type(default), path + ".")
        elif isinstance(default, list) and default and is_dataclass(default[0]):
            keys += schema_keys(type(default[0]), path + ".N.")
        elif isinstance(default, (list, tuple)) and default:
            keys.append(path + ".N")
    return keys


def _check_key(path: str, keys: tuple[str, ...], where: str) -> None:
    generic = ".".join("N" if part.isdigit() else part for part in path.split("."))
    if generic in keys:
        return
    close = difflib.get_close_matches(generic, keys, n=1, cutoff=0.5)
    example = ".".join("0" if part == "N" else part for part in close[0].split(".")) if close else None
    hint = f"; did you mean {example!r}?" if close else ""
    raise ConfigError(f"unknown config key {path!r}{hint} (valid keys are listed in {where})")


def _check_tree(tree: dict, keys: tuple[str, ...], where: str, prefix: str = "") -> None:
    for key, value in tree.items():
        path = f"{prefix}{key}"
        _check_key(path, keys, where)
        if isinstance(value, dict):
            _check_tree(value, keys, where, path + ".")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for i, item in enumerate(value):
                _check_tree(item, keys, where, f"{path}.{i}.")


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


def read_config_file(path: str | Path, configs_dir: str) -> dict:
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
                  where: str) -> DictConfig:
    """Schema `cfg` <- file `tree` <- `parsed` overrides, every key checked against `keys` (an unknown key
    names the closest valid one and `where` the keys are listed); type errors become ConfigErrors."""
    try:
        _check_tree(tree, keys, where)
        cfg = OmegaConf.merge(cfg, tree)
        for key, value in parsed:
            _check_key(key, keys, where)
            check_list_indices(cfg, key)
            key, value = whole_list_for_one_number(cfg, key, value)
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


SEQUENCES = (ListConfig, TupleConfig)      # a schema's list, and its tuple (a crop's scale)


def whole_list_for_one_number(cfg: DictConfig, key: str, value: object) -> tuple[str, object]:
    """An item of a list of numbers (`data.views.0.scale.0=0.5`) becomes the whole list with that item replaced:
    OmegaConf keeps a schema's tuple (the crop's scale) immutable item by item. Other keys pass unchanged."""
    parent, _, last = key.rpartition(".")
    items = OmegaConf.select(cfg, parent) if last.isdigit() else None
    if not isinstance(items, SEQUENCES) or any(isinstance(item, (DictConfig, *SEQUENCES)) for item in items):
        return key, value
    replaced = list(items)
    replaced[int(last)] = value
    return parent, replaced


def check_list_indices(cfg: DictConfig, key: str) -> None:
    """Refuse a dotted key that indexes past the end of a list (data.views.3.size with one view group)."""
    parts = key.split(".")
    for index, part in enumerate(parts):
        if part.isdigit():
            prefix = ".".join(parts[:index])
            node = OmegaConf.select(cfg, prefix)
            if isinstance(node, SEQUENCES) and int(part) >= len(node):
                raise ConfigError(f"{key}: {prefix} has {len(node)} item(s), numbered from 0; set an existing one "
                                  f"({prefix}.0...), or give the whole list as {prefix}=[...]")


def check_choices_and_ranges(cfg: DictConfig, choices: dict[str, tuple], ranges: tuple) -> None:
    """Refuse, by key and value, a value outside `choices`, a ZeRO stage outside 0-3, or a number outside
    `ranges` ((key, comparison, bound, meaning) rows as RUNTIME_RANGES; None values pass)."""
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
    """The optim.* keys that ranges alone cannot check (pretraining, fine-tuning, detection): the lr schedule, Adam's
    betas."""
    optim = cfg.optim
    betas = list(optim.betas)
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
        raise ConfigError(f"optim.betas={betas} must be two numbers in [0, 1): Adam's decay rates of the gradient's "
                          "mean and of its square, e.g. [0.9, 0.999]")
    if optim.min_lr > optim.lr:
        raise ConfigError(f"optim.min_lr={optim.min_lr} is above optim.lr={optim.lr}: the cosine decays from optim.lr "
                          "to min_lr")
    if optim.get("schedule_from_minutes", False):
        if not cfg.engine.get("max_minutes", 0) > 0:
            raise ConfigError("optim.schedule_from_minutes=true sizes the schedules from engine.max_minutes, which is "
                              "0: set engine.max_minutes=MINUTES, or optim.schedule_from_minutes=false to size them "
                              "with optim.epochs")
        if optim.get("budget_pflop", 0) > 0:
            raise ConfigError(f"optim.schedule_from_minutes=true and optim.budget_pflop={optim.budget_pflop:g} both "
                              "size the schedules: keep one (a compute budget is the same on every machine)")
    if optim.lr_schedule != "step":
        return
    milestones = list(optim.lr_milestones)
    if not milestones or any(not 0 < m < 1 for m in milestones) or milestones != sorted(set(milestones)):
        raise ConfigError(f"optim.lr_milestones={milestones} must be increasing fractions of training in (0, 1), "
                          "e.g. [0.5, 0.8] (the lr steps down at 50% and 80% of the steps)")
    if not 0 < optim.lr_step_factor <= 1:
        raise ConfigError(f"optim.lr_step_factor={optim.lr_step_factor} must lie in (0, 1]: the lr is multiplied by "
                          "it at every milestone (0.1 divides it by 10)")
    if optim.min_lr != 0:
        raise ConfigError(f"optim.min_lr={optim.min_lr} is the cosine's final lr, which optim.lr_schedule=step does "
                          "not use (it ends at lr x lr_step_factor ** len(lr_milestones)); set optim.min_lr=0, or "
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


