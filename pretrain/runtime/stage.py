"""What a stage that trains gives the training loop (pretrain/runtime/loop.py): its `LoopOptions` (the settings
the loop reads) and a `Stage` (its data, task, optimizer and schedules, what it records). `ConfiguredStage` is the
stage whose config has the shared `optim.*` / `engine.*` schema; the DeepSpeed config is built from the options.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from omegaconf import DictConfig

from pretrain.runtime.bf16_support import bf16_is_native
from pretrain.runtime.config_error import ConfigError
from pretrain.runtime.optim import Schedules, build_optimizer, divergence_advice, schedules_from_config
from pretrain.runtime.task import TrainingTask


@dataclass(frozen=True)
class LoopOptions:
    """The settings the loop reads; pretraining, fine-tuning and detection take them from their `optim.*` /
    `engine.*` keys (`from_config`)."""

    epochs: int                     # the schedules' length without a compute budget
    batch_size: int                 # per process and micro-batch
    grad_accum: int = 1             # micro-batches per optimizer step
    grad_clip: float = 0.0          # max global gradient norm; 0: no clipping
    grad_clip_per_parameter: float = 0.0   # max gradient norm of each parameter tensor (DINO's); 0: none
    seed: int = 0
    zero_stage: int = 0
    precision: str = "auto"         # auto (bf16 on GPUs with native bf16, else fp32) | bf16 | fp32
    budget_pflop: float = 0.0       # the schedules' length in counted compute, in place of epochs (0: epochs)
    schedule_from_minutes: bool = False   # the schedules' length from a timed step and max_minutes, in place of epochs
    max_steps: int = 0              # stop after this many optimizer steps (0: all epochs); schedules span all
    max_minutes: float = 0.0        # stop after this many minutes of training (TrainingClock; 0: no time budget)
    log_every_steps: int = 10
    print_every_steps: int = 10
    checkpoint_every_steps: int = 0  # 0: at epoch ends (and the last step) only
    checkpoint_every_minutes: float = 0.0   # of training, in place of the epoch ends' (0: at epoch ends)
    checkpoints_per_run: int = 0    # evenly spaced over the run's steps, in place of the epoch ends' (0: at epoch ends)
    keep_checkpoints: int = 0       # 0: keep all
    image_grid_every_steps: int = 0
    sync_batchnorm: bool = True     # GPUs, several processes
    channels_last: bool = False     # GPUs
    device: str = "auto"            # auto (CUDA when available) | cpu
    threads: int = 0                # CPU threads per process; 0: its share of the cores (cpu_threads.py)

    @classmethod
    def from_config(cls, cfg: DictConfig) -> LoopOptions:
        optim, engine = cfg.optim, cfg.engine
        return cls(epochs=optim.epochs, batch_size=cfg.data.batch_size, grad_accum=optim.grad_accum,
                   grad_clip=float(optim.grad_clip), grad_clip_per_parameter=float(optim.grad_clip_per_parameter),
                   seed=cfg.seed, zero_stage=engine.zero_stage, precision=engine.precision,
                   budget_pflop=float(optim.get("budget_pflop", 0.0)),
                   schedule_from_minutes=bool(optim.get("schedule_from_minutes", False)), max_steps=engine.max_steps,
                   max_minutes=float(engine.get("max_minutes", 0.0)),
                   log_every_steps=engine.log_every_steps, print_every_steps=engine.print_every_steps,
                   checkpoint_every_steps=engine.checkpoint_every_steps,
                   checkpoint_every_minutes=float(engine.get("checkpoint_every_minutes", 0.0)),
                   checkpoints_per_run=engine.get("checkpoints_per_run", 0),
                   keep_checkpoints=engine.keep_checkpoints,
                   image_grid_every_steps=engine.get("image_grid_every_steps", 0),
                   sync_batchnorm=engine.sync_batchnorm, channels_last=engine.channels_last,
                   threads=engine.get("threads", 0))


def uses_bf16(options: LoopOptions, device: torch.device) -> bool:
    """Whether a run's forwards run under bf16 autocast on `device` (engine.precision; auto: on a GPU with native bf16,
    pretrain/runtime/bf16_support.py; fp32 on CPUs and on older GPUs)."""
    return options.precision == "bf16" or (options.precision == "auto" and device.type == "cuda"
                                           and bf16_is_native(device))


def forward_autocast(device_type: str, bf16: bool) -> Callable[[], torch.autocast]:
    """The `autocast` a task's `batch_loss` opens around each of its forwards: a fresh bf16 autocast region on
    `device_type` at every call (disabled without `bf16`). Autocast caches the bf16 copy of each weight for its whole
    region, and under ZeRO-3, which gathers and releases the parameters around every forward, copies cached in one
    forward break the next one's backward."""
    return lambda: torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16)


def deepspeed_config(options: LoopOptions, bf16: bool) -> dict:
    """The DeepSpeed config of a run. `gradient_clipping` is always written: left out, DeepSpeed clips at 1.0.

    With `bf16`, the `torch_autocast` section: DeepSpeed's `engine.forward` turns a CUDA autocast region OFF inside
    the engine unless its config has that section (deepspeed/runtime/torch_autocast.py, `autocast_if_enabled`):
    without it every "bf16" forward on a GPU ran in fp32 (found on an H200, 2026-11-26; a CPU autocast region is
    not touched). `lower_precision_safe_modules: []`: DeepSpeed's default would mark the Linear and Conv weights to
    reduce their gradients in bf16; here every gradient stays fp32, as the fp32 master weights are.
    """
    config = {
        "train_micro_batch_size_per_gpu": options.batch_size,
        "gradient_accumulation_steps": options.grad_accum,
        "gradient_clipping": float(options.grad_clip),
        "zero_optimization": {"stage": options.zero_stage},
        "zero_allow_untested_optimizer": True,   # our optimizers are plain torch ones (LARS is not DeepSpeed's)
        "steps_per_print": 1 << 30,
    }
    if bf16:
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    return config


class EpochLoader(Protocol):
    """What the loop reads batches from: `len()` micro-batches per epoch and process (a multiple of grad_accum),
    `epoch(e, start_batch=k)` the micro-batches of epoch e from k on, `num_images` for the run-layout check."""

    num_images: int

    def __len__(self) -> int: ...

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Any]: ...


class Stage:
    """A run of a stage that trains, described for `run_training`. Subclasses set `name`, `run_dir` and `options`
    and define `build_loader`, `build_task`, `schedules` and `build_optimizer`; the other hooks have defaults."""

    name = "training"               # in messages: "training diverged in epoch ..."
    run_dir: Path
    options: LoopOptions
    # The errors of bad input that building the data or the task may raise: a start that raises one removes the
    # run directory it created (a refused start leaves nothing behind). Pretraining adds its DatasetError.
    input_errors: tuple[type[Exception], ...] = (ConfigError,)

    def check_inputs(self) -> None:
        """Before any process group or worker starts: raise for inputs that cannot work."""

    def check_resumable(self) -> None:
        """On every rank, before anything is written: refuse a run directory that holds another run."""

    def check_fresh_start(self) -> None:
        """When there is no checkpoint to resume: refuse if starting afresh would overwrite something."""

    def divergence_advice(self) -> str:
        """What to try when the run diverged, naming the stage's keys."""
        return "Try a lower learning rate, gradient clipping or a longer warm-up."

    def seed_generators(self) -> None:
        random.seed(self.options.seed)
        np.random.seed(self.options.seed)
        torch.manual_seed(self.options.seed)

    def build_loader(self, rank: int, world_size: int, device: torch.device) -> EpochLoader:
        """This rank's loader; raise ConfigError when it holds fewer than grad_accum micro-batches."""
        raise NotImplementedError

    def build_task(self, steps_per_epoch: int, schedule_steps: int, device: torch.device) -> TrainingTask:
        """The task, whose own schedules (DINO's teacher momentum) span `schedule_steps` optimizer steps, as the
        lr's do: the loop decides that length once (`pretrain.runtime.compute_budget.schedule_length`)."""
        raise NotImplementedError

    def schedules(self, steps_per_epoch: int, schedule_steps: int, global_batch: int) -> Schedules:
        """The lr and weight-decay schedules over `schedule_steps` optimizer steps."""
        raise NotImplementedError

    def build_optimizer(self, task: TrainingTask, peak_lr: float) -> torch.optim.Optimizer:
        raise NotImplementedError

    def record(self, task: TrainingTask, steps_per_epoch: int, rank: int) -> None:
        """After the resume decision (a refused start must not overwrite the record of the run it clashed with):
        write what ran (RUN_DIR/config.yaml) and say so, on rank 0. The loop then appends the start's code and
        machine to RUN_DIR/provenance.json (pretrain/runtime/provenance.py), the same for every stage."""

    def finish(self, engine, task: TrainingTask, step: int, epoch: int, rank: int) -> Any:
        """After the last step, on every rank; what `run_training` returns."""
        return None


class ConfiguredStage(Stage):
    """A stage whose config has the `optim.*` / `engine.*` schema of pretraining and fine-tuning: the loop's
    options, the schedules, the optimizer over the task's groups and the divergence advice all come from it."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.options = LoopOptions.from_config(cfg)

    def divergence_advice(self) -> str:
        return divergence_advice(self.cfg)

    def schedules(self, steps_per_epoch: int, schedule_steps: int, global_batch: int) -> Schedules:
        return schedules_from_config(self.cfg, steps_per_epoch, schedule_steps, global_batch)

    def build_optimizer(self, task: TrainingTask, peak_lr: float) -> torch.optim.Optimizer:
        return build_optimizer(self.cfg, task.param_groups(), peak_lr)
