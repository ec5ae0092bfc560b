"""Hyper-parameter sweeps: `--sweep optim.lr=0.1,0.2,0.4 method.temperature=0.1,0.2` is the product of the
values, one run each, submitted as one Slurm job array (launch/pretrain.py).

    combinations = sweep_combinations(["optim.lr=0.1,0.2", "method.temperature=0.1,0.2"])
    # [["optim.lr=0.1", "method.temperature=0.1"], ["optim.lr=0.1", "method.temperature=0.2"], ...]
    run_name("simclr", ["optim.lr=0.1", "method.temperature=0.2"])  ->  "simclr_lr0.1_temperature0.2"
"""
from __future__ import annotations

import itertools
import re

from launch.cluster import LaunchError


def sweep_combinations(specs: list[str]) -> list[list[str]]:
    """Every combination of the comma-separated values of each `key=v1,v2,...`, as override lists."""
    axes = []
    for spec in specs:
        if "=" not in spec:
            raise LaunchError(f"--sweep {spec!r} is not KEY=V1,V2,... (e.g. --sweep optim.lr=0.1,0.2)")
        key, values = spec.split("=", 1)
        choices = [v.strip() for v in values.split(",") if v.strip()]
        if not key or not choices:
            raise LaunchError(f"--sweep {spec!r} needs a key and at least one value (e.g. optim.lr=0.1,0.2)")
        if key in (k for k, _ in axes):
            raise LaunchError(f"--sweep names {key!r} twice; give all its values once: {key}=V1,V2,...")
        axes.append((key, choices))
    return [[f"{key}={value}" for (key, _), value in zip(axes, values)]
            for values in itertools.product(*(choices for _, choices in axes))]


def run_name(base: str, overrides: list[str]) -> str:
    """A run name that says which values it swept: the last part of each key and its value."""
    keys = [override.split("=", 1)[0] for override in overrides]
    short = [key.rsplit(".", 1)[-1] for key in keys]
    if len(set(short)) < len(short):                   # two keys end alike (e.g. model.lr, optim.lr)
        short = [key.replace(".", "-") for key in keys]
    parts = [f"{name}{override.split('=', 1)[1]}" for name, override in zip(short, overrides)]
    return "_".join([base, *(re.sub(r"[^A-Za-z0-9.+-]", "-", part) for part in parts)])
