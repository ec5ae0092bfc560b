"""Fine-tune a run's backbone export with a new linear head (or, --from random, the same network from scratch).

Full fine-tuning of the backbone export of a pretraining run, or of the same network from random
initialisation (--from random, the baseline), with top-1 / top-5 on the validation set after every epoch.

    python -m transfer finetune --run RUN_DIR [--config FILE] [--from export|random] [key=value ...]
    torchrun --nproc-per-node N -m transfer finetune --run-dir RUN_DIR --config FILE   (torchrun takes --run)

Training runs through the training loop of every stage (pretrain/runtime/loop.py; this stage and its task are in
transfer/finetune/stage.py): DeepSpeed ZeRO (engine.zero_stage), bf16 autocast on GPUs with fp32 weights,
checkpoints every engine.checkpoint_every_steps and at every epoch end, resume by rerunning the same command
(after a crash or SIGKILL too), SIGINT / SIGTERM / SIGUSR1 / SIGUSR2 finish the step, checkpoint and exit with
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

from omegaconf import OmegaConf

from eval.features import EvaluationInputError
from pretrain.config import ConfigError
from pretrain.data import DatasetError
from pretrain.runtime.checkpoint import CheckpointError
from pretrain.runtime.exit_status import exit_status_of, report
from pretrain.runtime.monitor import MetricsFileError
from pretrain.runtime.run_lock import RunDirectoryInUse
from transfer.finetune.config import load_finetune_config
from transfer.finetune.stage import resolve_inputs, train

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
                             "transfer/finetune/config.py)")
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
    try:
        cfg = load_finetune_config(args.config, args.overrides)
    except ConfigError as error:
        report(f"config error: {error}")
        return 2
    if args.print_config:
        print(OmegaConf.to_yaml(cfg))
        return 0
    return exit_status_of(lambda: train(cfg, resolve_inputs(cfg, args.run_dir, args.checkpoint, args.start)),
                        (ConfigError, DatasetError, EvaluationInputError, CheckpointError, RunDirectoryInUse,
                         MetricsFileError), "fine-tuning")
