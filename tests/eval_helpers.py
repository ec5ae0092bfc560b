"""Backbone exports and TensorBoard scalars for the evaluation tests (test_eval, test_retrieval): a random
ResNet-18 with the small stem, an export written in the format of `pretrain.checkpoint.export_backbone`, and
the scalars of a run's tb/ folder."""
from __future__ import annotations

from pathlib import Path

import torch

from pretrain.models import create_backbone

RESNET18_SMALL = create_backbone("resnet18", "small_stride2")


def write_export(path: Path, state_dict: dict, arch: str = "resnet18", stem: str = "small_stride2",
                 train: str | Path = "train.beton", val: str | Path = "val.beton", step: int = 120,
                 embedding_head: dict | None = None) -> Path:
    """embedding_head: the export's {in_dim, hidden_dim, out_dim, num_layers, state_dict} (None: no head)."""
    config = {"data": {"train": str(train), "val": str(val), "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25],
                       "views": [{"count": 2, "size": 32}], "num_workers": 0},
              "model": {"arch": arch, "stem": stem}}
    path.parent.mkdir(parents=True, exist_ok=True)
    export = {"arch": arch, "stem": stem, "state_dict": state_dict, "config": config, "epoch": 3, "step": step}
    if embedding_head is not None:
        export["embedding_head"] = embedding_head
    torch.save(export, path)
    return path


def read_scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(tb_dir))
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}
