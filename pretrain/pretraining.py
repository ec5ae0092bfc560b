"""Pretraining as a stage of the training loop (`pretrain/runtime/loop.py`): its data, its task and its schedules.

    views -> (hard view selection) -> forward -> loss        the method's `batch_loss` (pretrain/methods/base.py)
    -> [finite on every rank?] -> backward -> step -> after_step (EMA teacher, queues) -> log / checkpoint + export

The data are N views per image from the FFCV (or torchvision) loader, this rank's shard, whole optimizer steps
per epoch; the task is the method (`method.name`: backbone, heads, loss); the optimizer is `optim.name` over the
method's parameter groups with the warm-up + cosine lr and the cosine weight decay; every checkpoint exports
the backbone (RUN_DIR/backbone.pth) for eval and transfer.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from pretrain.config import ConfigError, run_dir_of, views_to_draw
from pretrain.data import DatasetError
from pretrain.data.loader import build_view_loader, check_held_out_data, check_training_data
from pretrain.data.writer import is_unlabeled
from pretrain.export import check_fresh_start
from pretrain.methods import build_method, method_module
from pretrain.methods.base import Method
from pretrain.runtime.atomic_write import write_text_atomically
from pretrain.runtime.checkpoint import check_resumable
from pretrain.runtime.loop import run_training
from pretrain.runtime.stage import ConfiguredStage


class Pretraining(ConfiguredStage):
    """The pretraining run that `cfg` describes (schedules and optimizer: `ConfiguredStage`, from optim.*)."""

    name = "training"
    input_errors = (ConfigError, DatasetError)

    def __init__(self, cfg: DictConfig):
        super().__init__(cfg)
        self.run_dir = run_dir_of(cfg)

    def check_inputs(self) -> None:
        cfg = self.cfg
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise ConfigError(f"run_dir={self.run_dir} is a file; the run directory holds checkpoints, exports and "
                              "logs: pass a folder (or leave run_dir out for runs/NAME)")
        check_training_data(cfg.data.train, cfg.data.backend)
        check_held_out_data(cfg.data.val)
        if cfg.data.backend == "ffcv" and is_unlabeled(cfg.data.train):
            if method_module(cfg.method.name).METHOD.needs_labels(cfg):
                raise ConfigError(f"data.train={cfg.data.train} has no labels (written with --unlabeled), but "
                                  f"method.name={cfg.method.name} trains on class labels with these settings: "
                                  "pretrain a self-supervised method on it, or write a labelled set")
            if cfg.monitor.online_probe:
                raise ConfigError(f"data.train={cfg.data.train} has no labels (written with --unlabeled), which the "
                                  "online linear probe trains on: set monitor.online_probe=false")

    def check_resumable(self) -> None:
        # What makes another run, and what the optimizer's groups hold (a resumed optimizer restores its saved
        # groups: momentum, betas, SimSiam's fixed predictor lr, DINO's frozen last layer would silently stay as
        # they were). Values such as optim.lr and the weight decay may change: they apply from the resumed step on.
        check_resumable(self.run_dir / "config.yaml", self.cfg,
                        ("model.arch", "model.stem", "method.name", "model.proj_out_dim", "optim.name",
                         "optim.momentum", "optim.betas", "optim.decay_norm_and_bias", "method.fix_pred_lr",
                         "method.freeze_last_layer_epochs"))

    def check_fresh_start(self) -> None:
        check_fresh_start(self.run_dir)

    def build_loader(self, rank: int, world_size: int, device: torch.device):
        cfg = self.cfg
        loader = build_view_loader(
            cfg.data.train, views_to_draw(cfg), cfg.data.batch_size, backend=cfg.data.backend, device=device,
            canvas_size=cfg.data.canvas_size, mean=tuple(cfg.data.mean), std=tuple(cfg.data.std),
            num_workers=cfg.data.num_workers, seed=cfg.seed, rank=rank, world_size=world_size,
            batches_per_step=cfg.optim.grad_accum, batch_design=OmegaConf.to_object(cfg.data.batch_design))
        if len(loader) == 0:
            raise ConfigError(f"{cfg.data.train} gives fewer than optim.grad_accum={cfg.optim.grad_accum} batches of "
                              f"data.batch_size={cfg.data.batch_size} per process per epoch ({loader.num_images} "
                              f"images, {world_size} processes): lower data.batch_size or optim.grad_accum")
        return loader

    def build_task(self, steps_per_epoch: int, schedule_steps: int, device: torch.device) -> Method:
        return build_method(self.cfg, steps_per_epoch, schedule_steps)

    def record(self, task: Method, steps_per_epoch: int, rank: int) -> None:
        if rank == 0:
            write_text_atomically(self.run_dir / "config.yaml", OmegaConf.to_yaml(self.cfg, resolve=True))

    def finish(self, engine, task: Method, step: int, epoch: int, rank: int) -> Path:
        if rank == 0:
            print(f"done: {self.run_dir} at step {step}; backbone export {self.run_dir / 'backbone.pth'}", flush=True)
            write_text_atomically(self.run_dir / "finished.json", json.dumps({"step": step, "epoch": epoch}))
        return self.run_dir


def train(cfg: DictConfig) -> Path:
    """Run (or resume) the pretraining described by `cfg`; return the run directory.

    Raises, on every rank: ConfigError, pretrain.data.DatasetError, CheckpointError, RunDirectoryInUse (bad
    input: nothing was trained); TrainingDiverged; StopRequested (a signal: a checkpoint was saved).
    """
    return run_training(Pretraining(cfg))
