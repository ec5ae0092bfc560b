"""Fine-tuning as a stage of the training loop (`pretrain/runtime/loop.py`): its data, its task and its result.

    crops -> RandAugment / random erasing / mixup -> classifier -> (soft-target) cross-entropy     `FinetuneTask`
    -> [finite on every rank?] -> backward -> step -> [epoch end: top-1 / top-5 on the validation set] -> log
    -> checkpoint

The data are one RandomResizedCrop + flip per image of the labelled subset (data.label_fraction), this rank's
shard, whole optimizer steps per epoch; the task is the export's backbone (or the same network at random) with a
new linear head; the optimizer is `optim.name` over the layer-decayed parameter groups with the warm-up + cosine
lr. The command is transfer/finetune/__init__.py; it resolves the inputs (`resolve_inputs`) before any process starts.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from eval.features import BackboneExport, EvaluationInputError, load_backbone_export, resolve_checkpoint_path
from eval.results import evaluation_crop_fraction, evaluation_image_size, write_results
from pretrain.config import ConfigError
from pretrain.data import DatasetError
from pretrain.data.loader import build_image_loader, build_view_loader, check_training_data
from pretrain.data.views import ViewBatch
from pretrain.data.writer import is_unlabeled
from pretrain.runtime.atomic_write import write_text_atomically
from pretrain.runtime.checkpoint import check_resumable
from pretrain.runtime.distributed import average_buffers
from pretrain.runtime.loop import run_training
from pretrain.runtime.stage import ConfiguredStage, uses_bf16
from pretrain.runtime.task import BatchLoss, BatchPosition, TrainingTask
from transfer.classifier import build_classifier, layer_decay_param_groups
from transfer.finetune.augment import BatchAugmentation, seed_batch_generators
from transfer.finetune.config import label_fraction_name, parse_label_fraction, train_view_group
from transfer.label_fraction import label_subset_for_run, labels_and_class_names

# ============ inputs: the export, the data, the labels ============


@dataclass
class FinetuneInputs:
    """What a fine-tuning run reads, resolved and checked before any process group starts, and where it writes.
    `export`, `checkpoint`, `out_dir`, `train_path`, `val_path` are the fields eval's `write_results` reads."""

    export: BackboneExport
    checkpoint: Path             # the export file
    out_dir: Path                # RUN_DIR: the result goes to RUN_DIR/eval and RUN_DIR/tb
    start: str                   # export | random
    train_path: Path
    val_path: Path
    backend: str                 # ffcv (.beton) | torchvision (image folder), from the training data's type
    train_labels: np.ndarray
    num_classes: int
    num_val: int
    label_fraction: float
    image_size: int
    canvas_size: int
    crop_fraction: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    finetune_dir: Path

    @property
    def protocol(self) -> str:
        return f"finetune_{label_fraction_name(self.label_fraction)}_{self.start}"


def resolve_inputs(cfg: DictConfig, run: str | None, checkpoint: str | None, start: str) -> FinetuneInputs:
    """Load the export and resolve the data; raise (one line, what to do) EvaluationInputError for a missing or
    broken export, ConfigError for settings that cannot work, DatasetError for data that cannot be read or whose
    training and validation classes do not match."""
    from pretrain.data.ffcv_loader import check_beton_fields   # FFCV: heavy, loaded only where .beton data are read

    if run is not None and not Path(run).is_dir():
        raise EvaluationInputError(f"--run {run}: no such run directory; pass the directory `python -m pretrain` "
                                   "wrote (runs/NAME), or --checkpoint FILE")
    checkpoint_path = resolve_checkpoint_path(run, checkpoint)
    export = load_backbone_export(checkpoint_path)
    exported = export.config.get("data", {})

    def data_path(split: str) -> Path:
        path = cfg.data[split] or exported.get(split)
        if not path:
            raise ConfigError(f"the export's config has no data.{split}, and none is set: pass data.{split}=PATH "
                              "(a .beton or an image folder)")
        return Path(path)

    train_path, val_path = data_path("train"), data_path("val")
    for split, path in (("train", train_path), ("val", val_path)):
        if path.is_file() and is_unlabeled(path):
            raise ConfigError(f"data.{split}={path} has no labels (written with --unlabeled), which fine-tuning "
                              f"trains and scores on: pass data.{split}=PATH to a labelled .beton or image folder")
    backend = "torchvision" if train_path.is_dir() else "ffcv"
    check_training_data(train_path, backend)
    if not val_path.exists():
        raise DatasetError(f"data.val={str(val_path)!r} does not exist: pass data.val=PATH (a .beton written by "
                           "`python -m pretrain.data` or an image folder)")
    if val_path.is_file():
        check_beton_fields(val_path)
    image_size = cfg.data.image_size or evaluation_image_size(export.config)
    if image_size is None:
        raise ConfigError(f"the config in {checkpoint_path} has no data.views[0].size: pass data.image_size=PIXELS")
    mean, std = exported.get("mean"), exported.get("std")
    if mean is None or std is None:
        raise EvaluationInputError(f"the config in {checkpoint_path} has no data.mean / data.std to normalise images "
                                   "with; re-export the backbone from a run with a complete config")

    # ---- labels: the same classes on both sides, every training image labelled ----
    train_labels, train_classes = labels_and_class_names(train_path)
    val_labels, val_classes = labels_and_class_names(val_path)
    for path, labels in ((train_path, train_labels), (val_path, val_labels)):
        if len(labels) == 0 or labels.min() < 0:
            raise DatasetError(f"{path} holds images without a class label: fine-tuning needs a labelled .beton "
                               "(`python -m pretrain.data write --image-folder DIR` with one sub-folder per class) or "
                               "an image folder")
    if train_classes is not None and val_classes is not None and train_classes != val_classes:
        raise DatasetError(f"the training and validation data have different classes ({train_path}: "
                           f"{len(train_classes)} classes {train_classes[:5]}...; {val_path}: {len(val_classes)} "
                           f"classes {val_classes[:5]}...): pass data.train / data.val of the same dataset")
    num_classes = len(train_classes) if train_classes is not None else int(train_labels.max()) + 1
    if int(val_labels.max()) >= num_classes:
        raise DatasetError(f"{val_path} has class label {int(val_labels.max())}, but {train_path} has only "
                           f"{num_classes} classes: pass data.train / data.val of the same dataset")

    fraction = parse_label_fraction(cfg.data.label_fraction)
    out_dir = Path(run) if run is not None else checkpoint_path.parent
    name = f"{cfg.name}_{label_fraction_name(fraction)}_{start}_step{export.step:07d}"
    canvas_size = cfg.data.canvas_size if cfg.data.canvas_size is not None else exported.get("canvas_size")  # 0 counts
    return FinetuneInputs(
        export=export, checkpoint=checkpoint_path, out_dir=out_dir, start=start, train_path=train_path,
        val_path=val_path, backend=backend, train_labels=train_labels, num_classes=num_classes,
        num_val=len(val_labels), label_fraction=fraction, image_size=int(image_size),
        canvas_size=int(image_size if canvas_size is None else canvas_size),
        crop_fraction=float(cfg.data.eval_crop_fraction or evaluation_crop_fraction(export.config)),
        mean=tuple(mean), std=tuple(std), finetune_dir=out_dir / "finetune" / name)


# ============ the task: images -> classifier -> loss, and the validation at every epoch end ============


def evaluate(model, loader, bf16: bool) -> tuple[float, float]:
    """Top-1 and top-5 accuracy (fractions) of `model` (the DeepSpeed engine, or any module) on every image of
    `loader` ((images, labels, indices) batches), in eval mode; the model is back in train mode afterwards.

    Every process evaluates the whole set (under ZeRO-3 every forward is a collective, so all must run the same
    batches); BatchNorm statistics are averaged across processes first, as before a checkpoint."""
    average_buffers(getattr(model, "module", model))
    model.eval()
    top1 = top5 = total = 0
    with torch.no_grad():
        for images, labels, _ in loader:
            with torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = model(images)
            ranked = logits.float().topk(min(5, logits.shape[1]), dim=1).indices
            hits = ranked == labels.view(-1, 1)
            top1 += int(hits[:, 0].sum())
            top5 += int(hits.any(dim=1).sum())
            total += len(labels)
    model.train()
    return top1 / total, top5 / total


class FinetuneTask(TrainingTask):
    """The classifier (`model`: the export's backbone + a new head) as the training loop's task; at every epoch end
    (and the last step) top-1 / top-5 on the validation set, kept with the checkpoints (`evaluations`)."""

    def __init__(self, model: torch.nn.Module, augmentation: BatchAugmentation, val_loader, layer_decay: float,
                 seed: int, bf16: bool, epochs: int):
        super().__init__()
        self.model = model
        self.augmentation, self.val_loader = augmentation, val_loader
        self.layer_decay, self.seed, self.bf16, self.epochs = layer_decay, seed, bf16, epochs
        self.evaluations: list[dict] = []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def param_groups(self) -> list[dict]:
        return layer_decay_param_groups(self.model, self.layer_decay)

    def batch_loss(self, engine, batch: ViewBatch, position: BatchPosition, autocast) -> BatchLoss:
        # timm's RandAugment, RandomErasing and Mixup and the backbone's drop path draw from the global generators
        seed_batch_generators(self.seed, position.rank, position.epoch, position.batch)
        images, targets = self.augmentation(batch.views[0][:, 0], batch.labels)
        with autocast():
            logits = engine(images)
        return BatchLoss(self.augmentation.loss(logits.float(), targets))

    def after_epoch(self, engine, epoch: int, step: int) -> dict[str, float]:
        top1, top5 = evaluate(engine, self.val_loader, self.bf16)
        self.evaluations.append({"epoch": epoch + 1, "step": step, "top1": top1, "top5": top5})
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"epoch {epoch + 1}/{self.epochs} (step {step}): val top-1 {100 * top1:.2f}%  top-5 "
                  f"{100 * top5:.2f}%", file=sys.stderr, flush=True)
        return {"val/top1": top1, "val/top5": top5}

    def state_outside_engine(self) -> dict:
        return {"evaluations": self.evaluations}

    def load_state_outside_engine(self, state: dict) -> None:
        self.evaluations = list(state.get("evaluations", []))


# ============ the run ============

# What a resumed fine-tuning must share with the run in its directory: everything that shapes what it learns
# (engine.* and the loading settings may change; the run layout -- processes, batch, epochs, seed -- is also
# checked against the checkpoint).
RESUME_KEYS = ("seed", "optim", "model", "augment", "mixup", "loss", "data.label_fraction", "data.label_seed",
               "data.image_size", "data.eval_crop_fraction")


class Finetuning(ConfiguredStage):
    """The fine-tuning of `inputs` as `cfg` describes, in RUN_DIR/finetune/NAME_FRACTION_FROM_stepNNNNNNN."""

    name = "fine-tuning"
    input_errors = (ConfigError, DatasetError)

    def __init__(self, cfg: DictConfig, inputs: FinetuneInputs):
        super().__init__(cfg)
        self.inputs = inputs
        self.run_dir = inputs.finetune_dir
        self.started = time.perf_counter()
        resolved = OmegaConf.to_container(cfg, resolve=True)     # what runs: the export's defaults filled in
        resolved["data"].update(train=str(inputs.train_path), val=str(inputs.val_path), image_size=inputs.image_size,
                                canvas_size=inputs.canvas_size, eval_crop_fraction=inputs.crop_fraction)
        self.resolved = resolved

    def check_resumable(self) -> None:
        check_resumable(self.run_dir / "config.yaml", self.resolved, RESUME_KEYS)

    def seed_generators(self) -> None:
        seed_batch_generators(self.cfg.seed)

    def build_loader(self, rank: int, world_size: int, device: torch.device):
        cfg, inputs = self.cfg, self.inputs
        self.subset = label_subset_for_run(self.run_dir, inputs.train_labels, inputs.label_fraction,
                                           cfg.data.label_seed, write=rank == 0)
        loader = build_view_loader(
            inputs.train_path, [train_view_group(cfg, inputs.image_size)], cfg.data.batch_size, backend=inputs.backend,
            device=device, canvas_size=inputs.canvas_size, mean=inputs.mean, std=inputs.std,
            num_workers=cfg.data.num_workers, seed=cfg.seed, rank=rank, world_size=world_size,
            batches_per_step=cfg.optim.grad_accum, subset=self.subset)
        if len(loader) == 0:
            raise ConfigError(f"the {len(self.subset)} labelled images ({inputs.label_fraction:.0%} of "
                              f"{inputs.train_path}) give fewer than optim.grad_accum={cfg.optim.grad_accum} batches "
                              f"of data.batch_size={cfg.data.batch_size} per process ({world_size} processes): lower "
                              "data.batch_size or optim.grad_accum")
        return loader

    def build_task(self, steps_per_epoch: int, schedule_steps: int, device: torch.device) -> FinetuneTask:
        cfg, inputs = self.cfg, self.inputs
        val_loader = build_image_loader(inputs.val_path, inputs.image_size, cfg.data.eval_batch_size, device=device,
                                        mean=inputs.mean, std=inputs.std, num_workers=cfg.data.num_workers,
                                        crop_fraction=inputs.crop_fraction)
        augmentation = BatchAugmentation(cfg, inputs.num_classes, inputs.image_size, inputs.mean, inputs.std, device)
        model = build_classifier(inputs.export, inputs.start, inputs.num_classes,
                                 drop_path_rate=cfg.model.drop_path_rate, head_init_std=cfg.model.head_init_std,
                                 seed=cfg.seed)
        return FinetuneTask(model, augmentation, val_loader, cfg.optim.layer_decay, cfg.seed,
                            uses_bf16(self.options, device), math.ceil(schedule_steps / steps_per_epoch))

    def record(self, task: FinetuneTask, steps_per_epoch: int, rank: int) -> None:
        if rank == 0:
            inputs = self.inputs
            write_text_atomically(self.run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(self.resolved)))
            print(f"fine-tuning {inputs.export.arch} from {inputs.start} ({inputs.checkpoint}, step "
                  f"{inputs.export.step}) on {len(self.subset)} labelled images of {inputs.train_path} "
                  f"({inputs.num_classes} classes), {steps_per_epoch} steps per epoch; run directory {self.run_dir}",
                  flush=True)

    def finish(self, engine, task: FinetuneTask, step: int, epoch: int, rank: int) -> dict:
        """The result: RUN_DIR/eval/finetune_FRACTION_FROM_stepNNNNNNN.json and RUN_DIR/tb (rank 0 writes)."""
        result = finetune_result(self.cfg, self.inputs, task.evaluations, task.epochs, len(self.subset),
                                 time.perf_counter() - self.started)
        if rank == 0:
            write_finetune_result(self.inputs, result)
        return result


def train(cfg: DictConfig, inputs: FinetuneInputs) -> dict:
    """Run (or resume) the fine-tuning of `inputs` as `cfg` describes; return the result written to
    RUN_DIR/eval (on every rank).

    Raises, on every rank: ConfigError, DatasetError, CheckpointError, RunDirectoryInUse (bad input: nothing
    was trained); TrainingDiverged; StopRequested (a signal: a checkpoint was saved).
    """
    return run_training(Finetuning(cfg, inputs))


def finetune_result(cfg: DictConfig, inputs: FinetuneInputs, evaluations: list[dict], epochs: int, num_train: int,
                    seconds: float) -> dict:
    """The numbers a fine-tuning reports: top-1 / top-5 after the last epoch (the headline), the best epoch's top-1
    (chosen on the validation set, so optimistic, as DINO's eval_linear.py reports it), every evaluation."""
    last = evaluations[-1] if evaluations else {"top1": float("nan"), "top5": float("nan")}
    best = max(evaluations, key=lambda e: e["top1"], default={"top1": float("nan"), "epoch": 0})
    return {"top1": last["top1"], "top5": last["top5"], "best_top1": best["top1"], "best_epoch": best["epoch"],
            "from": inputs.start, "label_fraction": inputs.label_fraction, "num_train": num_train,
            "num_val": inputs.num_val, "num_classes": inputs.num_classes, "image_size": inputs.image_size,
            "crop_fraction": inputs.crop_fraction, "epochs": epochs, "config_name": cfg.name,
            "finetune_dir": str(inputs.finetune_dir), "evaluations": evaluations, "seconds": round(seconds, 1)}


def write_finetune_result(inputs: FinetuneInputs, result: dict) -> Path:
    """RUN_DIR/eval/{protocol}_stepNNNNNNN.json and TensorBoard scalars eval/{protocol}_top1 / _top5 / _best_top1 at
    the export's step, through eval's `write_results`; prints the result."""
    protocol = inputs.protocol
    details = {key: value for key, value in result.items() if key != "top1"}
    path = write_results(inputs, protocol, result["top1"],
                         {f"eval/{protocol}_top1": result["top1"], f"eval/{protocol}_top5": result["top5"],
                          f"eval/{protocol}_best_top1": result["best_top1"]}, details)
    print(f"fine-tuning ({inputs.label_fraction:.0%} of the labels, from {inputs.start}): top-1 "
          f"{100 * result['top1']:.2f}%  top-5 {100 * result['top5']:.2f}% after the last epoch; best top-1 "
          f"{100 * result['best_top1']:.2f}% (epoch {result['best_epoch']}, chosen on the validation set)")
    print(f"results: {path}")
    return path
