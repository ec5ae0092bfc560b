"""Pretraining methods, one per file; the protocol they share is in `pretrain/methods/base.py`.

`method.name=NAME` selects `pretrain/methods/NAME.py`: its `Options` dataclass is the `method.*` section
of the config and its `METHOD` class is the model. Adding a method is that one file (plus, if it brings a
new loss, one file in `pretrain/losses/`) and a config under `configs/pretrain/`.
"""
from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from omegaconf import DictConfig

from pretrain.methods.base import Method


def method_module(name: str) -> ModuleType | None:
    """The module of method `name`, or None if there is no such method."""
    if not name.isidentifier() or name not in available_methods():
        return None
    return importlib.import_module(f"{__name__}.{name}")


def available_methods() -> list[str]:
    """Names of the method files in this package (every module except the protocol)."""
    return sorted(info.name for info in pkgutil.iter_modules(__path__) if info.name != "base")


def build_method(cfg: DictConfig, steps_per_epoch: int = 1, schedule_steps: int = 1) -> Method:
    """The method named by `cfg.method.name`. Its own schedules (DINO's teacher momentum and temperature) span
    `schedule_steps` optimizer steps, the run's length, which the training loop decides once for every schedule
    (`pretrain.runtime.compute_budget.schedule_length`); `steps_per_epoch` converts the `method.*_epochs` keys to
    steps. A method built outside a run (a test, `bench`) gets a one-step schedule unless it is given one."""
    return method_module(cfg.method.name).METHOD(cfg, steps_per_epoch, schedule_steps)
