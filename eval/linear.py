"""Linear probe: a linear classifier trained on frozen features, reported as validation top-1 accuracy.

The head follows MAE (He et al. 2022, "Masked Autoencoders Are Scalable Vision Learners", Sec. A.2):
a BatchNorm without affine parameters standardises the features (their scale differs a lot between
methods and would otherwise need a per-method learning rate), then one linear layer. It is trained with
SGD + momentum under a cosine learning-rate schedule, without weight decay.

Both report validation top-1 after the last epoch (`ProbeAccuracy.final`, the headline number) and the best
over epochs with its epoch (`best`, what DINO's eval_linear.py reports: a choice made on the validation
set, so it is optimistic by construction).

Two ways to feed it:
- `train_linear_probe` on cached features (one forward of the backbone per image; fast, the default);
- `train_linear_probe_on_views` on fresh RandomResizedCrop + flip views every epoch through the frozen
  backbone (the augmented protocol of SimCLR / DINO; slower, usually a little more accurate).

`python -m eval linear` (the end of this file) trains it on a backbone export: `add_arguments`, `run`.
"""
from __future__ import annotations

import argparse
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from eval.features import resolve_device
from eval.inputs import EvaluationInputs, add_common_options, print_header, random_seed
from eval.results import write_results
from eval.stop_points import stop_point
from pretrain.data.loader import build_view_loader
from pretrain.data.views import ViewBatch, ViewGroup
from pretrain.runtime.argument_types import number, positive_int


class ViewEpochs(Protocol):
    """What the augmented probe needs from a view loader: one iterable of `ViewBatch`es per epoch."""

    def epoch(self, epoch: int) -> Iterable[ViewBatch]: ...


@dataclass
class ProbeAccuracy:
    """Validation top-1 (fractions) after the last epoch and at the best epoch (1-based)."""

    final: float
    best: float
    best_epoch: int


def accuracy_by_epoch(per_epoch: list[float]) -> ProbeAccuracy:
    best_epoch = max(range(len(per_epoch)), key=lambda epoch: per_epoch[epoch])   # the first of equal ones
    return ProbeAccuracy(final=per_epoch[-1], best=per_epoch[best_epoch], best_epoch=best_epoch + 1)


class LinearProbe(nn.Module):
    """BatchNorm1d(affine=False) then Linear: MAE's linear-probe head on (B, num_features) inputs."""

    def __init__(self, num_features: int, num_classes: int):
        super().__init__()
        self.standardise = nn.BatchNorm1d(num_features, affine=False, eps=1e-6)
        self.classifier = nn.Linear(num_features, num_classes)
        nn.init.trunc_normal_(self.classifier.weight, std=0.01)
        nn.init.zeros_(self.classifier.bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.standardise(features))


def cosine_learning_rate(base_lr: float, progress: float) -> float:
    """Cosine decay from `base_lr` at progress 0 to 0 at progress 1 (Loshchilov & Hutter 2017, no restarts)."""
    return 0.5 * base_lr * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))


@torch.no_grad()
def linear_probe_accuracy(head: nn.Module, features: torch.Tensor, labels: torch.Tensor,
                          batch_size: int = 1024) -> float:
    """Top-1 accuracy (a fraction) of `head` on `features`, evaluated in eval mode on the head's device."""
    device = next(head.parameters()).device
    was_training = head.training
    head.eval()
    correct = 0
    for start in range(0, len(features), batch_size):
        logits = head(features[start:start + batch_size].to(device).float())
        correct += int((logits.argmax(dim=1) == labels[start:start + batch_size].to(device)).sum())
    head.train(was_training)
    return correct / len(features)


def _check_probe_inputs(train_labels: torch.Tensor, val_labels: torch.Tensor, epochs: int, lr: float,
                        batch_size: int) -> int:
    """Validate the common options and return the number of classes."""
    if epochs < 1:
        raise ValueError(f"epochs={epochs} must be at least 1")
    if lr <= 0:
        raise ValueError(f"lr={lr} must be positive (0.1 works for standardised features)")
    if batch_size < 2:
        raise ValueError(f"batch_size={batch_size} must be at least 2 (the BatchNorm needs two samples)")
    if len(train_labels) == 0 or len(val_labels) == 0:
        raise ValueError(f"need train and val samples; got {len(train_labels)} and {len(val_labels)}")
    if int(train_labels.min()) < 0 or int(val_labels.min()) < 0:
        raise ValueError("labels must be class indices >= 0; a .beton without labels cannot train a linear probe")
    return int(max(train_labels.max(), val_labels.max())) + 1


def train_linear_probe(train_features: torch.Tensor, train_labels: torch.Tensor,
                       val_features: torch.Tensor, val_labels: torch.Tensor, *,
                       epochs: int = 100, lr: float = 0.1, batch_size: int = 256, momentum: float = 0.9,
                       weight_decay: float = 0.0, device: str | torch.device = "auto", seed: int = 0) -> ProbeAccuracy:
    """Train `LinearProbe` on cached features; return its validation top-1 after the last and the best epoch.

    train_features: (N, D) float, train_labels: (N,) class indices; val_features / val_labels likewise.
    epochs, lr, batch_size, momentum, weight_decay: SGD with a per-step cosine schedule from `lr` to 0.
      Batches are reshuffled every epoch; a final batch of one sample is dropped (BatchNorm needs two).
    device: "auto" (CUDA when available), "cpu", "cuda", ...; features are moved there once.
    seed: seeds the classifier's initialisation and the shuffling, so a run is reproducible.

    Example:
        >>> top1 = train_linear_probe(train_x, train_y, val_x, val_y, epochs=100).final
    """
    num_classes = _check_probe_inputs(train_labels, val_labels, epochs, lr, batch_size)
    device = resolve_device(device)
    torch.manual_seed(seed)
    head = LinearProbe(train_features.shape[1], num_classes).to(device)
    optimizer = torch.optim.SGD(head.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    features = train_features.to(device).float()
    labels = train_labels.to(device).long()
    shuffle = torch.Generator().manual_seed(seed)
    steps_per_epoch = math.ceil(len(features) / batch_size)
    total_steps = epochs * steps_per_epoch
    per_epoch = []
    for epoch in range(epochs):
        head.train()
        order = torch.randperm(len(features), generator=shuffle).to(device)
        for batch_index, start in enumerate(range(0, len(features), batch_size)):
            stop_point()               # a watcher's stop signal, taken here (eval/stop_points.py)
            batch = order[start:start + batch_size]
            if len(batch) < 2:
                continue
            step = epoch * steps_per_epoch + batch_index
            for group in optimizer.param_groups:
                group["lr"] = cosine_learning_rate(lr, step / total_steps)
            loss = F.cross_entropy(head(features[batch]), labels[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        per_epoch.append(linear_probe_accuracy(head, val_features, val_labels))
    return accuracy_by_epoch(per_epoch)


def train_linear_probe_on_views(backbone: nn.Module, view_batches_per_epoch: ViewEpochs,
                                val_features: torch.Tensor, val_labels: torch.Tensor, *,
                                num_classes: int, epochs: int = 100, lr: float = 0.1, momentum: float = 0.9,
                                weight_decay: float = 0.0, device: str | torch.device = "auto",
                                seed: int = 0) -> ProbeAccuracy:
    """Train `LinearProbe` on augmented views through the frozen `backbone`; return val top-1 after the last
    and the best epoch.

    backbone: the frozen encoder; it stays in eval mode (BatchNorm statistics are not updated) and runs
      under `torch.no_grad()`.
    view_batches_per_epoch: anything with `.epoch(epoch) -> Iterable[ViewBatch]` (the pretraining view
      loader built with one group of one view); the first view of the first group is used. Its views
      must already be on `device`, or they are moved there.
    val_features, val_labels: the un-augmented validation set encoded by the same backbone
      (`extract_features`); the probe is evaluated on them after the last epoch.
    num_classes: the number of classes (labels are 0..num_classes-1).
    epochs, lr, momentum, weight_decay, device, seed: as in `train_linear_probe`; the cosine schedule
      advances per step when the loader has a length, else per epoch.
    """
    if epochs < 1 or lr <= 0:
        raise ValueError(f"epochs={epochs} must be >= 1 and lr={lr} positive")
    device = resolve_device(device)
    torch.manual_seed(seed)
    backbone = backbone.to(device).eval()
    head = LinearProbe(int(backbone.num_features), num_classes).to(device)
    optimizer = torch.optim.SGD(head.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    try:
        steps_per_epoch = len(view_batches_per_epoch)  # type: ignore[arg-type]
    except TypeError:
        steps_per_epoch = 1  # unknown length: the schedule moves once per epoch
    per_epoch = []
    for epoch in range(epochs):
        head.train()
        for batch_index, batch in enumerate(view_batches_per_epoch.epoch(epoch)):
            stop_point()               # a watcher's stop signal, taken here (eval/stop_points.py)
            progress = (epoch + min(batch_index, steps_per_epoch - 1) / steps_per_epoch) / epochs
            for group in optimizer.param_groups:
                group["lr"] = cosine_learning_rate(lr, progress)
            views = batch.views[0][:, 0].to(device, non_blocking=True)
            labels = batch.labels.to(device, non_blocking=True).long()
            if len(labels) < 2:
                continue
            with torch.no_grad():
                features = backbone(views).flatten(1).float()
            loss = F.cross_entropy(head(features), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        per_epoch.append(linear_probe_accuracy(head, val_features, val_labels))
    return accuracy_by_epoch(per_epoch)


# ============ python -m eval linear ============

HELP = "linear probe on frozen features"
DESCRIPTION = ("Linear probe (MAE head: BatchNorm without affine, then Linear) trained with SGD + momentum and a "
               "cosine schedule on frozen features; reports validation top-1 after the last epoch (top1) and the best "
               "over epochs (best_top1, as DINO's eval_linear.py; chosen on the validation set).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_options(parser)
    parser.add_argument("--augment", action="store_true",
                        help="train on fresh RandomResizedCrop(0.08-1) + flip views every epoch through the frozen "
                             "backbone instead of cached features (slower); validation stays un-augmented")
    parser.add_argument("--epochs", type=positive_int, default=100,
                        help="training epochs of the linear classifier (default: %(default)s)")
    # The probe standardises its features (BatchNorm), so one lr range fits every backbone: MAE's probe peaks at 6.4
    # (0.1 x 16384 / 256); beyond 10 the weights blow up (1e300 is not even a float32).
    parser.add_argument("--lr", type=number(float, above=0, at_most=10), default=0.1,
                        help="peak learning rate of the cosine schedule, in (0, 10] (default: %(default)s)")
    parser.add_argument("--batch-size", type=number(int, at_least=2), default=256, metavar="N",
                        help="linear-probe batch size, at least 2: the probe's BatchNorm standardises each batch "
                             "(default: %(default)s)")
    parser.add_argument("--momentum", type=number(float, at_least=0, below=1), default=0.9,
                        help="SGD momentum, in [0, 1) (default: %(default)s)")
    parser.add_argument("--weight-decay", type=number(float, at_least=0, at_most=1), default=0.0,
                        help="SGD weight decay, in [0, 1] (default: %(default)s)")
    parser.add_argument("--seed", type=random_seed, default=0,
                        help="seed of the classifier init, shuffling and augmentation (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    """Linear probe on frozen features (cached, or fresh augmented views with --augment), written to
    RUN_DIR/eval/linear[_augmented]_step{step}.json and printed."""
    started = time.perf_counter()
    inputs = EvaluationInputs(args)
    inputs.check_same_classes()
    features = inputs.features()
    num_train, num_val = len(features["train_labels"]), len(features["val_labels"])
    if args.augment:
        protocol = "linear_augmented"
        num_classes = int(max(features["train_labels"].max(), features["val_labels"].max())) + 1
        accuracy = train_linear_probe_on_views(inputs.export.backbone, build_augmented_views(inputs, args),
                                               features["val_features"], features["val_labels"],
                                               num_classes=num_classes, epochs=args.epochs, lr=args.lr,
                                               momentum=args.momentum, weight_decay=args.weight_decay,
                                               device=inputs.device, seed=args.seed)
    else:
        protocol = "linear"
        accuracy = train_linear_probe(features["train_features"], features["train_labels"],
                                      features["val_features"], features["val_labels"], epochs=args.epochs,
                                      lr=args.lr, batch_size=args.batch_size, momentum=args.momentum,
                                      weight_decay=args.weight_decay, device=inputs.device, seed=args.seed)
    seconds = time.perf_counter() - started
    path = write_results(inputs, protocol, accuracy.final,
                         {f"eval/{protocol}_top1": accuracy.final, f"eval/{protocol}_best_top1": accuracy.best},
                         {"best_top1": accuracy.best, "best_epoch": accuracy.best_epoch,
                          "epochs": args.epochs, "lr": args.lr, "batch_size": args.batch_size,
                          "augment": bool(args.augment), "seed": args.seed, "num_train": num_train,
                          "num_val": num_val, "seconds": round(seconds, 3)})
    title = "linear probe" + (" (augmented views)" if args.augment else " (cached features)")
    print_header(title, inputs, num_train, num_val, seconds)
    print(f"  epochs {args.epochs}   top-1 after the last epoch {100 * accuracy.final:6.2f}%   best "
          f"{100 * accuracy.best:6.2f}% (epoch {accuracy.best_epoch}, chosen on the validation set)")
    print(f"results: {path}")
    return 0


def build_augmented_views(inputs: EvaluationInputs, args: argparse.Namespace):
    """The training set as one RandomResizedCrop(0.08-1) + flip view per image, fresh every epoch."""
    group = ViewGroup(count=1, size=inputs.image_size, scale=(0.08, 1.0), jitter_p=0.0, grayscale_p=0.0)
    canvas_size = inputs.export.config.get("data", {}).get("canvas_size")          # 0 (the decoded image) counts
    canvas_size = inputs.image_size if canvas_size is None else canvas_size
    return build_view_loader(inputs.train_path, [group], args.batch_size, device=inputs.device,
                             canvas_size=canvas_size, mean=inputs.mean, std=inputs.std,
                             num_workers=inputs.num_workers, seed=args.seed, drop_last=True)
