"""What the evaluation tests (test_eval*.py, test_retrieval.py) share: a random ResNet-18 with the
small stem, an export written in the format of `pretrain.export.export_backbone`, the scalars of a run's tb/
folder, and in-memory images to stand in for the image loader (`planted_image_dataset`, `shuffled_batches`). (A
small or read-only filesystem to write to: tests/run_helpers.py, `small_filesystem`.)"""
from __future__ import annotations

from pathlib import Path

import torch

from pretrain.models import create_backbone


RESNET18_SMALL = create_backbone("resnet18", "small_stride2")


def write_export(path: Path, state_dict: dict, arch: str = "resnet18", stem: str = "small_stride2",
                 train: str | Path = "train.beton", val: str | Path = "val.beton", step: int = 120,
                 embedding_head: dict | None = None, eval_image_size: int | None = None,
                 eval_crop_fraction: float | None = None) -> Path:
    """embedding_head: the export's {in_dim, hidden_dim, out_dim, num_layers, state_dict} (None: no head).
    eval_image_size, eval_crop_fraction: the side and crop of the run's own evaluation (its config's
    data.eval_image_size and data.eval_crop_fraction; None: left out, as in exports written before they existed:
    the views' 32 px and 0.875). A result at another side or crop is named apart (`evaluation_suffix`)."""
    evaluation = {"eval_image_size": eval_image_size, "eval_crop_fraction": eval_crop_fraction}
    config = {"data": {"train": str(train), "val": str(val), "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25],
                       "views": [{"count": 2, "size": 32}], "num_workers": 0,
                       **{key: value for key, value in evaluation.items() if value is not None}},
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


def shuffled_batches(images, labels, batch_size, seed=0):
    """An in-memory stand-in for the image loader: `(images, labels, indices)` in a shuffled order."""
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))
    return [(images[i], labels[i], i) for i in order.split(batch_size)]


def planted_image_dataset(count: int, seed: int, side: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Images whose class is a bright quadrant: easy for any encoder, raw pixels included."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(count) % 4
    images = 0.1 * torch.randn(count, 3, side, side, generator=generator)
    half = side // 2
    for quadrant in range(4):
        row, col = divmod(quadrant, 2)
        images[labels == quadrant, :, half * row:half * row + half, half * col:half * col + half] += 2.0
    return images, labels
