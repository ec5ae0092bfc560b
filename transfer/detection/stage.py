"""Detection as a stage of the training loop (pretrain/runtime/loop.py): the detector's run on the digit scenes,
then its evaluation (COCO mAP on the val scenes) and its result."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from eval.features import BackboneExport
from eval.results import result_path, write_result
from pretrain.runtime.atomic_write import write_text_atomically
from pretrain.runtime.checkpoint import check_resumable
from pretrain.runtime.config_error import ConfigError
from pretrain.runtime.distributed import average_buffers
from pretrain.runtime.stage import ConfiguredStage
from transfer.detection.coco_metrics import coco_box_metrics
from transfer.detection.predict import predict
from transfer.detection.scenes import SceneLoader, SceneSplit
from transfer.detection.task import DetectionTask, detection_backbone
from transfer.detector import build_detector


# What a resumed detection run must share with the run in its directory (engine.* and data.eval_batch_size may change).
RESUME_KEYS = ("seed", "data.root", "data.num_train", "data.num_val", "data.image_size", "data.seed", "data.generate",
               "data.batch_size", "model", "optim")


@dataclass
class DetectionInputs:
    """What a detection run reads, resolved and checked before it starts."""

    export: BackboneExport
    run_dir: Path                # the pretraining run: results go to RUN_DIR/eval and RUN_DIR/tb
    init: str                    # export | random
    device: str                  # auto | cpu
    mean: list[float]
    std: list[float]
    paths: dict[str, Path]
    train: SceneSplit
    val: SceneSplit

    @property
    def training_dir(self) -> Path:
        """RUN_DIR/detection/detection_{init}_stepNNNNNNN: the detector's checkpoints, logs and config."""
        return self.run_dir / "detection" / f"detection_{self.init}_step{self.export.step:07d}"


class DetectionTraining(ConfiguredStage):
    """The detector's training run: Faster R-CNN (C4) on the export; the loop's options, the schedules (warm-up +
    cosine) and the optimizer (SGD) come from the optim.* / engine.* keys, as fine-tuning's do."""

    name = "detection"

    def __init__(self, cfg: DictConfig, inputs: DetectionInputs):
        super().__init__(cfg)
        self.options = replace(self.options, device=inputs.device)     # --device: cpu, or auto
        self.inputs = inputs
        self.run_dir = inputs.training_dir
        self.started = time.perf_counter()

    def check_resumable(self) -> None:
        check_resumable(self.run_dir / "config.yaml", self.cfg, RESUME_KEYS)

    def build_loader(self, rank: int, world_size: int, device: torch.device) -> SceneLoader:
        cfg = self.cfg
        loader = SceneLoader(self.inputs.train, cfg.data.batch_size, cfg.seed, rank, world_size, device)
        if len(loader) < cfg.optim.grad_accum:
            raise ConfigError(f"the {loader.num_images} training scenes give {len(loader)} batches of data.batch_size="
                              f"{cfg.data.batch_size} per process, fewer than optim.grad_accum={cfg.optim.grad_accum}: "
                              "lower data.batch_size or optim.grad_accum")
        return loader

    def build_task(self, steps_per_epoch: int, schedule_steps: int, device: torch.device) -> DetectionTask:
        inputs = self.inputs
        resnet = detection_backbone(inputs.export, inputs.init, self.cfg.seed)
        torch.manual_seed(self.cfg.seed)              # the RPN and the box predictor start from this seed
        detector = build_detector(resnet, self.cfg, inputs.train.num_classes, int(inputs.train.images.shape[-1]),
                                  inputs.mean, inputs.std)
        return DetectionTask(detector.to(device), self.cfg.engine.print_every_steps)

    def record(self, task: DetectionTask, steps_per_epoch: int, rank: int) -> None:
        self.steps_per_epoch = steps_per_epoch
        if rank == 0:
            write_text_atomically(self.run_dir / "config.yaml", OmegaConf.to_yaml(self.cfg, resolve=True))

    def finish(self, engine, task: DetectionTask, step: int, epoch: int, rank: int) -> Path | None:
        """Evaluate the trained detector on the val scenes (rank 0) and write the result."""
        inputs = self.inputs
        train_seconds = time.perf_counter() - self.started
        average_buffers(task)
        if rank != 0:
            return None
        device = next(task.parameters()).device
        detections = predict(task.detector, inputs.val, self.cfg.data.eval_batch_size, device)
        metrics, summary = coco_box_metrics(inputs.val.json_path, detections)
        seconds = time.perf_counter() - self.started
        details = {"train": str(inputs.paths["train_json"]), "val": str(inputs.paths["val_json"]),
                   "num_train": len(inputs.train.image_ids), "num_val": len(inputs.val.image_ids),
                   "num_detections": len(detections), "device": str(device), "training_dir": str(self.run_dir),
                   "train_seconds": round(train_seconds, 1), "seconds": round(seconds, 1), "iterations": step,
                   "iterations_per_epoch": self.steps_per_epoch, "final_losses": task.final_losses(),
                   "config": OmegaConf.to_container(self.cfg, resolve=True)}
        path = write_detection_result(inputs, metrics, detections, details)
        print(summary, end="")
        print(f"detection from {inputs.init}: mAP {100 * metrics['map']:.2f}  AP50 {100 * metrics['ap50']:.2f}  "
              f"(at most {self.cfg.model.box_detections_per_img} detections per image; {step} iterations, "
              f"{train_seconds:.0f} s training, {seconds:.0f} s in all)")
        print(f"results: {path}")
        return path


def write_detection_result(inputs: DetectionInputs, metrics: dict[str, float], detections: list[dict],
                           details: dict[str, Any]) -> Path:
    """RUN_DIR/eval/detection_{init}_stepNNNNNNN.json, its detections file (..._detections.json) and TensorBoard
    scalars, through eval's one result writer."""
    export, init = inputs.export, inputs.init
    name = f"detection_{init}"
    result = {"protocol": "detection", "from": init, "step": export.step, "epoch": export.epoch,
              "checkpoint": str(export.path), "arch": export.arch, "stem": export.stem,
              "map": metrics["map"], "ap50": metrics["ap50"], "coco_stats": metrics,
              "metric": "pycocotools COCOeval bbox: map = AP@[0.50:0.95], 101-point interpolated; ap50 = AP@0.50",
              "max_detections_per_image": details["config"]["model"]["box_detections_per_img"],
              "detections": str(result_path(inputs.run_dir, name, export.step, "_detections.json")), **details}
    prefix = "eval/detection_" if init == "export" else "eval/detection_random_"
    return write_result(inputs.run_dir, name, export.step, result,
                        {prefix + "map": metrics["map"], prefix + "ap50": metrics["ap50"]},
                        {"_detections.json": json.dumps(detections)})
