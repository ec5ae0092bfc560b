"""The detector as the training loop's task: the detector's backbone (the export, or its architecture at random
initialisation) and the sum of its losses on a batch of scenes."""
from __future__ import annotations

from collections import deque

import timm
import torch
from torch import nn

from eval.features import BackboneExport
from pretrain.models import create_backbone
from pretrain.runtime.task import BatchLoss, BatchPosition, TrainingTask
from transfer.detection.input_error import DetectionInputError
from transfer.detection.scenes import SceneBatch


def detection_backbone(export: BackboneExport, init: str, seed: int) -> nn.Module:
    """The exported ResNet (`init="export"`) or the same architecture at random initialisation."""
    if not isinstance(export.backbone, timm.models.resnet.ResNet):
        raise DetectionInputError(f"{export.path} holds a {export.arch!r} backbone; the detection command supports "
                                  "ResNets (timm resnet*) only: pretrain a ResNet (model.arch=resnet18 / resnet50)")
    if init == "export":
        return export.backbone
    torch.manual_seed(seed)
    zero_init = bool(export.config.get("model", {}).get("zero_init_residual", False))
    return create_backbone(export.arch, export.stem, zero_init_residual=zero_init)


class DetectionTask(TrainingTask):
    """The detector as the training loop's task: images + boxes -> the detector's losses (RPN objectness and box
    regression, box-head classification and regression), summed."""

    def __init__(self, detector: nn.Module, print_every: int):
        super().__init__()
        self.detector = detector
        self.recent: deque[dict[str, float]] = deque(maxlen=print_every)   # the last losses, for the result

    def forward(self, images: list[torch.Tensor], targets: list[dict] | None = None):
        return self.detector(images, targets)

    def batch_loss(self, engine, batch: SceneBatch, position: BatchPosition, autocast) -> BatchLoss:
        with autocast():
            losses = engine(batch.images, batch.targets)
        parts = {name: value.item() for name, value in losses.items()}
        self.recent.append(parts)
        return BatchLoss(sum(losses.values()), {f"train/{name}": value for name, value in parts.items()})

    def final_losses(self) -> dict[str, float]:
        """The mean of each loss over the last engine.print_every_steps iterations."""
        return {name: sum(r[name] for r in self.recent) / len(self.recent) for name in self.recent[-1]} \
            if self.recent else {}
