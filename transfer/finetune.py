"""Fine-tune a run's backbone export with a new linear head (or, --from random, the same network from scratch).

Full fine-tuning of the backbone export of a pretraining run, or of the same network from random
initialisation (--from random, the baseline), with top-1 / top-5 on the validation set after every epoch.

    python -m transfer finetune --run RUN_DIR [--config FILE] [--from export|random] [key=value ...]
    torchrun --nproc-per-node N -m transfer finetune --run-dir RUN_DIR --config FILE   (torchrun takes --run)

The engine is pretraining's: DeepSpeed ZeRO (engine.zero_stage), bf16 autocast on GPUs with fp32 weights,
checkpoints every engine.checkpoint_every_steps and at every epoch end, resume by rerunning the same command
(after a crash or SIGKILL too), SIGINT / SIGTERM / SIGUSR2 finish the step, checkpoint and exit with
128 + signal, TensorBoard and metrics.jsonl. Recipes (configs/transfer/): warm-up + cosine, label smoothing,
layer-wise lr decay, drop path, timm's RandAugment, random erasing and mixup / cutmix, and a class-balanced
label fraction (data.label_fraction=1% / 10%).

Reads RUN_DIR/backbone.pth (or --checkpoint FILE) and its config: the data (data.train, data.val) and image
size default to the pretraining run's. Writes the fine-tuning run to
RUN_DIR/finetune/NAME_FRACTION_FROM_stepNNNNNNN/ (config.yaml, label_subset.json, checkpoints/, tb/,
metrics.jsonl; NAME is the config's name, the step the export's), and the result to
RUN_DIR/eval/finetune_FRACTION_FROM_stepNNNNNNN.json with TensorBoard scalars eval/finetune_... in RUN_DIR/tb
at the export's step.

Exit status: 0 done; 1 training diverged; 2 bad input, nothing trained (run, export, config, data, checkpoint,
run directory in use); 128 + N stopped by signal N after saving a checkpoint (rerun to resume).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the command line imports this module for --help; torch and DeepSpeed load only to train
    import numpy as np
    import torch
    from omegaconf import DictConfig

    from eval.features import BackboneExport


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
        from transfer.finetune_config import label_fraction_name
        return f"finetune_{label_fraction_name(self.label_fraction)}_{self.start}"


def resolve_inputs(cfg: DictConfig, run: str | None, checkpoint: str | None, start: str) -> FinetuneInputs:
    """Load the export and resolve the data; raise (one line, what to do) EvaluationInputError for a missing or
    broken export, ConfigError for settings that cannot work, DatasetError for data that cannot be read or whose
    training and validation classes do not match."""
    from eval.features import (EvaluationInputError, evaluation_crop_fraction, evaluation_image_size,
                               load_backbone_export, resolve_checkpoint_path)
    from pretrain.config import ConfigError
    from pretrain.data import DatasetError
    from pretrain.data.ffcv_loader import check_beton_fields
    from pretrain.data.loader import check_training_data
    from transfer.finetune_config import label_fraction_name, parse_label_fraction
    from transfer.label_fraction import labels_and_class_names

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
    return FinetuneInputs(
        export=export, checkpoint=checkpoint_path, out_dir=out_dir, start=start, train_path=train_path,
        val_path=val_path, backend=backend, train_labels=train_labels, num_classes=num_classes,
        num_val=len(val_labels), label_fraction=fraction, image_size=int(image_size),
        canvas_size=int(cfg.data.canvas_size or exported.get("canvas_size") or image_size),
        crop_fraction=float(cfg.data.eval_crop_fraction or evaluation_crop_fraction(export.config)),
        mean=tuple(mean), std=tuple(std), finetune_dir=out_dir / "finetune" / name)


# ============ the engine, the step and the evaluation ============


def finetune_deepspeed_config(cfg: DictConfig) -> dict:
    """Pretraining's DeepSpeed config (`pretrain.engine.deepspeed_config`), with gradient clipping always set:
    DeepSpeed 0.19 clips the global norm at 1.0 when `gradient_clipping` is absent, so optim.grad_clip=0 would
    otherwise clip every step of a recipe that asks for none (SimCLR's, DeiT's)."""
    from pretrain.engine import deepspeed_config

    return {**deepspeed_config(cfg), "gradient_clipping": float(cfg.optim.grad_clip)}


def train_step(engine, images: torch.Tensor, targets: torch.Tensor, loss_fn, bf16: bool) -> torch.Tensor:
    """One micro-step: forward -> loss -> [finite on every rank?] -> backward -> optimizer step (DeepSpeed steps
    at the end of each gradient-accumulation cycle). Raises NonFiniteLoss, on every rank, before the backward
    of a loss that is NaN or inf on any rank: the parameters stay those of the last step."""
    import torch

    from pretrain.engine import NonFiniteLoss, finite_on_every_rank

    with torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = engine(images)
    loss = loss_fn(logits.float(), targets)
    if not finite_on_every_rank(loss):
        raise NonFiniteLoss(loss.item())
    engine.backward(loss)
    engine.step()
    return loss.detach()


def evaluate(model, loader, bf16: bool) -> tuple[float, float]:
    """Top-1 and top-5 accuracy (fractions) of `model` (the DeepSpeed engine, or any module) on every image of
    `loader` ((images, labels, indices) batches), in eval mode; the model is back in train mode afterwards.

    Every process evaluates the whole set (under ZeRO-3 every forward is a collective, so all must run the same
    batches); BatchNorm statistics are averaged across processes first, as before a checkpoint."""
    import torch

    from pretrain.checkpoint import average_buffers

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


# ============ the run ============


def train(cfg: DictConfig, inputs: FinetuneInputs) -> dict:
    """Run (or resume) the fine-tuning of `inputs` as `cfg` describes; return the result written to
    RUN_DIR/eval (on every rank).

    Raises, on every rank: ConfigError, DatasetError, CheckpointError, RunDirectoryInUse (bad input: nothing
    was trained); TrainingDiverged; StopRequested (a signal: a checkpoint was saved).
    """
    import logging
    from contextlib import closing

    import deepspeed
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch import nn

    from pretrain.checkpoint import (parameters_finite_on_every_rank, resume_from_newest_loadable, run_layout,
                                     save_checkpoint, write_text_atomically)
    from pretrain.config import ConfigError
    from pretrain.data.loader import build_image_loader, build_view_loader
    from pretrain.engine import NonFiniteLoss, TrainingDiverged, init_distributed
    from pretrain.graceful_stop import GracefulStop, StopRequested
    from pretrain.monitor import TrainingMonitor
    from pretrain.optim import build_optimizer, cosine_schedule, scaled_lr, set_schedule_values
    from pretrain.run_lock import locked_run_directory
    from transfer.classifier import build_classifier, layer_decay_param_groups
    from transfer.finetune_augment import BatchAugmentation, seed_batch_generators
    from transfer.finetune_config import train_view_group
    from transfer.label_fraction import label_subset_for_run

    # ==== processes, run directory, seeds ====
    started = time.perf_counter()
    rank, world_size, device = init_distributed()
    run_dir = inputs.finetune_dir
    checkpoint_dir = run_dir / "checkpoints"
    with GracefulStop() as stop, locked_run_directory(run_dir, rank):
        if rank == 0:
            checkpoint_dir.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        seed_batch_generators(cfg.seed)
        bf16 = cfg.engine.precision == "bf16" or (cfg.engine.precision == "auto" and device.type == "cuda")

        # ==== data: the labelled subset, one crop per image, whole optimizer steps per epoch ====
        subset = label_subset_for_run(run_dir, inputs.train_labels, inputs.label_fraction, cfg.data.label_seed,
                                      write=rank == 0)
        loader = build_view_loader(
            inputs.train_path, [train_view_group(cfg, inputs.image_size)], cfg.data.batch_size,
            backend=inputs.backend, device=device, canvas_size=inputs.canvas_size, mean=inputs.mean, std=inputs.std,
            num_workers=cfg.data.num_workers, seed=cfg.seed, rank=rank, world_size=world_size,
            batches_per_step=cfg.optim.grad_accum, subset=subset)
        if len(loader) == 0:
            raise ConfigError(f"the {len(subset)} labelled images ({inputs.label_fraction:.0%} of {inputs.train_path}) "
                              f"give fewer than optim.grad_accum={cfg.optim.grad_accum} batches of "
                              f"data.batch_size={cfg.data.batch_size} per process ({world_size} processes): lower "
                              "data.batch_size or optim.grad_accum")
        steps_per_epoch = len(loader) // cfg.optim.grad_accum
        val_loader = build_image_loader(inputs.val_path, inputs.image_size, cfg.data.eval_batch_size, device=device,
                                        mean=inputs.mean, std=inputs.std, num_workers=cfg.data.num_workers,
                                        crop_fraction=inputs.crop_fraction)
        augmentation = BatchAugmentation(cfg, inputs.num_classes, inputs.image_size, inputs.mean, inputs.std, device)

        # ==== model: the export's backbone (or the same one at random) + a new linear head ====
        model = build_classifier(inputs.export, inputs.start, inputs.num_classes,
                                 drop_path_rate=cfg.model.drop_path_rate, head_init_std=cfg.model.head_init_std,
                                 seed=cfg.seed)
        if device.type == "cuda" and world_size > 1 and cfg.engine.sync_batchnorm:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)   # never on CPU: it raises there

        # ==== optimizer (layer-wise lr decay), schedules, DeepSpeed engine ====
        global_batch = cfg.data.batch_size * world_size * cfg.optim.grad_accum
        peak_lr = scaled_lr(cfg, global_batch)
        total_steps = cfg.optim.epochs * steps_per_epoch
        lr_schedule = cosine_schedule(peak_lr, cfg.optim.min_lr, total_steps,
                                      int(cfg.optim.warmup_epochs * steps_per_epoch))
        wd_end = cfg.optim.weight_decay if cfg.optim.weight_decay_end is None else cfg.optim.weight_decay_end
        wd_schedule = cosine_schedule(cfg.optim.weight_decay, wd_end, total_steps)
        optimizer = build_optimizer(cfg, layer_decay_param_groups(model, cfg.optim.layer_decay), peak_lr)
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                       config=finetune_deepspeed_config(cfg))

        # ==== resume: the newest checkpoint that loads, else a fresh start ====
        start_epoch, start_batch, evaluations = 0, 0, []
        resumed = resume_from_newest_loadable(engine, checkpoint_dir, run_layout(cfg, world_size, loader.num_images))
        if resumed is not None:
            trainer_state, client_state = resumed
            start_epoch, start_batch = trainer_state["epoch"], trainer_state["batch_in_epoch"]
            evaluations = list(client_state.get("evaluations", []))
            if start_batch >= len(loader):
                start_epoch, start_batch = start_epoch + 1, 0
            if rank == 0:
                print(f"resumed {run_dir} at step {engine.global_steps} (epoch {start_epoch}, batch {start_batch})",
                      flush=True)
        if rank == 0:   # what ran: the command's config with the export's defaults filled in
            resolved = OmegaConf.to_container(cfg, resolve=True)
            resolved["data"].update(train=str(inputs.train_path), val=str(inputs.val_path),
                                    image_size=inputs.image_size, canvas_size=inputs.canvas_size,
                                    eval_crop_fraction=inputs.crop_fraction)
            write_text_atomically(run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(resolved)))
            print(f"fine-tuning {inputs.export.arch} from {inputs.start} ({inputs.checkpoint}, step "
                  f"{inputs.export.step}) on {len(subset)} labelled images of {inputs.train_path} "
                  f"({inputs.num_classes} classes), {steps_per_epoch} steps per epoch; run directory {run_dir}",
                  flush=True)
        stop_step = min(total_steps, cfg.engine.max_steps) if cfg.engine.max_steps > 0 else total_steps
        monitor = TrainingMonitor(run_dir, stop_step, enabled=rank == 0,
                                  print_every_steps=cfg.engine.print_every_steps,
                                  resumed_step=engine.global_steps if resumed is not None else None)
        saved_step = engine.global_steps if resumed is not None else None

        def checkpoint(epoch: int, batch_in_epoch: int) -> None:
            nonlocal saved_step
            step = engine.global_steps
            if not parameters_finite_on_every_rank(engine.module):
                raise TrainingDiverged(diverged(f"the parameters are NaN or inf after step {step}", epoch))
            save_checkpoint(engine, checkpoint_dir,
                            {"step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch,
                             **run_layout(cfg, world_size, loader.num_images)},
                            {"evaluations": evaluations}, cfg.engine.keep_checkpoints)
            saved_step = step

        def diverged(what: str, epoch: int) -> str:
            kept = (f"The last checkpoint ({checkpoint_dir / f'step{saved_step:08d}'}) is finite and kept; rerunning "
                    "the same command resumes from there" if saved_step is not None else
                    "No checkpoint had been saved yet; rerunning the same command starts afresh")
            return (f"fine-tuning diverged in epoch {epoch}: {what}. {kept}. Try a lower optim.lr (now "
                    f"{cfg.optim.lr}), gradient clipping (optim.grad_clip=1.0) or a longer warm-up "
                    f"(optim.warmup_epochs, now {cfg.optim.warmup_epochs}).")

        # ==== training loop ====
        engine.train()
        epoch = start_epoch
        try:
            while epoch < cfg.optim.epochs and engine.global_steps < stop_step:
                waited, images_seen, loss_sum = 0.0, 0, 0.0
                tick = window_start = time.perf_counter()
                batch_index = start_batch
                # closing(): FFCV's decode thread is stopped and joined when the loop is left early
                with closing(loader.epoch(epoch, start_batch=start_batch)) as batches:
                    for batch in batches:
                        step = engine.global_steps            # optimizer steps taken before this micro-batch
                        waited += time.perf_counter() - tick
                        set_schedule_values(optimizer, lr_schedule[step], wd_schedule[step], peak_lr, step)
                        seed_batch_generators(cfg.seed, rank, epoch, batch_index)
                        images, targets = augmentation(batch.views[0][:, 0], batch.labels)
                        try:
                            loss = train_step(engine, images, targets, augmentation.loss, bf16)
                        except NonFiniteLoss as error:
                            raise TrainingDiverged(diverged(f"the loss is {error.value} in step {step + 1}, "
                                                            "which was not applied", epoch)) from None
                        batch_index += 1
                        images_seen += batch.batch_size * world_size
                        loss_sum += loss.item()
                        if engine.global_steps == step:      # inside a gradient-accumulation cycle
                            tick = time.perf_counter()
                            continue
                        done = engine.global_steps

                        # ---- evaluation at every epoch end (and at the last step) ----
                        scalars = {}
                        evaluated = batch_index == len(loader) or done == stop_step
                        if evaluated:
                            top1, top5 = evaluate(engine, val_loader, bf16)
                            evaluations.append({"epoch": epoch + 1, "step": done, "top1": top1, "top5": top5})
                            scalars = {"val/top1": top1, "val/top5": top5}
                            if rank == 0:
                                print(f"epoch {epoch + 1}/{cfg.optim.epochs} (step {done}): val top-1 "
                                      f"{100 * top1:.2f}%  top-5 {100 * top5:.2f}%", file=sys.stderr, flush=True)

                        # ---- logging: the step's mean over its micro-batches and over the processes ----
                        if done % cfg.engine.log_every_steps == 0 or done == stop_step or evaluated:
                            elapsed = time.perf_counter() - window_start
                            mean_loss = torch.tensor([loss_sum / cfg.optim.grad_accum], device=device)
                            dist.all_reduce(mean_loss)
                            monitor.log(done, epoch, {"train/loss": mean_loss.item() / world_size,
                                                      "train/lr": float(lr_schedule[step]),
                                                      "train/weight_decay": float(wd_schedule[step]),
                                                      "perf/images_per_s": images_seen / max(elapsed, 1e-9),
                                                      "perf/data_wait_frac": waited / max(elapsed, 1e-9), **scalars})
                            waited, images_seen, window_start = 0.0, 0, time.perf_counter()
                        loss_sum = 0.0

                        # ---- checkpoint; stop on a signal ----
                        every = cfg.engine.checkpoint_every_steps
                        if (every and done % every == 0) or evaluated:
                            checkpoint(epoch, batch_index)
                        if done >= stop_step:           # the run is complete: a late signal changes nothing
                            break
                        signum = stop.requested_on_any_rank(device)
                        if signum:
                            if saved_step != done:
                                checkpoint(epoch, batch_index)
                            raise StopRequested(f"stopped on a signal after step {done}, saved in "
                                                f"{checkpoint_dir / f'step{done:08d}'}; rerun the same command "
                                                "to resume", signum)
                        tick = time.perf_counter()
                epoch, start_batch = epoch + 1, 0
        finally:
            monitor.close()

        # ==== result: RUN_DIR/eval/finetune_FRACTION_FROM_stepNNNNNNN.json and RUN_DIR/tb ====
        result = finetune_result(cfg, inputs, evaluations, len(subset), time.perf_counter() - started)
        if rank == 0:
            write_finetune_result(inputs, result)
        dist.barrier()
    return result


def finetune_result(cfg: DictConfig, inputs: FinetuneInputs, evaluations: list[dict], num_train: int,
                    seconds: float) -> dict:
    """The numbers a fine-tuning reports: top-1 / top-5 after the last epoch (the headline), the best epoch's top-1
    (chosen on the validation set, so optimistic, as DINO's eval_linear.py reports it), every evaluation."""
    last = evaluations[-1] if evaluations else {"top1": float("nan"), "top5": float("nan")}
    best = max(evaluations, key=lambda e: e["top1"], default={"top1": float("nan"), "epoch": 0})
    return {"top1": last["top1"], "top5": last["top5"], "best_top1": best["top1"], "best_epoch": best["epoch"],
            "from": inputs.start, "label_fraction": inputs.label_fraction, "num_train": num_train,
            "num_val": inputs.num_val, "num_classes": inputs.num_classes, "image_size": inputs.image_size,
            "crop_fraction": inputs.crop_fraction, "epochs": cfg.optim.epochs, "config_name": cfg.name,
            "finetune_dir": str(inputs.finetune_dir), "evaluations": evaluations, "seconds": round(seconds, 1)}


def write_finetune_result(inputs: FinetuneInputs, result: dict) -> Path:
    """RUN_DIR/eval/{protocol}_stepNNNNNNN.json and TensorBoard scalars eval/{protocol}_top1 / _top5 / _best_top1 at
    the export's step, through eval's `write_results`; prints the result."""
    from eval.__main__ import write_results

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


# ============ command line ============


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", "--run-dir", dest="run_dir", metavar="RUN_DIR",   # not `run`: __main__ sets args.run
                        help="pretraining run directory: fine-tunes RUN_DIR/backbone.pth, writes RUN_DIR/finetune/..., "
                             "RUN_DIR/eval and RUN_DIR/tb (under torchrun write --run-dir: torchrun reads --run as "
                             "its own --run-path)")
    parser.add_argument("--checkpoint", metavar="FILE",
                        help="fine-tune this backbone export (e.g. RUN_DIR/exports/backbone_stepNNNNNNNN.pth) instead "
                             "of RUN_DIR/backbone.pth; results go to RUN_DIR when --run is given, else next to FILE")
    parser.add_argument("--config", metavar="FILE",
                        help="fine-tuning recipe, YAML under configs/transfer/ (omit for the defaults of "
                             "transfer/finetune_config.py)")
    parser.add_argument("--from", dest="start", choices=("export", "random"), default="export",
                        help="start from the export's weights, or train the same network from random initialisation "
                             "(the baseline) (default: %(default)s)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    # The deepspeed launcher passes --local_rank; the process group reads LOCAL_RANK from the environment.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides of the config, e.g. data.label_fraction=10%% optim.epochs=30 "
                             "engine.zero_stage=2")


def run(args: argparse.Namespace) -> int:
    """Fine-tune as `args` say; the exit status (see the module docstring). Never exits the process itself: the
    launcher calls this in every task of a job."""
    from pretrain.config import ConfigError
    from pretrain.exit_status import report, run_training
    from transfer.finetune_config import load_finetune_config

    try:
        cfg = load_finetune_config(args.config, args.overrides)
    except ConfigError as error:
        report(f"config error: {error}")
        return 2
    if args.print_config:
        from omegaconf import OmegaConf
        print(OmegaConf.to_yaml(cfg))
        return 0

    from eval.features import EvaluationInputError
    from pretrain.checkpoint import CheckpointError
    from pretrain.data import DatasetError
    from pretrain.monitor import MetricsFileError
    from pretrain.run_lock import RunDirectoryInUse

    return run_training(lambda: train(cfg, resolve_inputs(cfg, args.run_dir, args.checkpoint, args.start)),
                        (ConfigError, DatasetError, EvaluationInputError, CheckpointError, RunDirectoryInUse,
                         MetricsFileError), "fine-tuning")
