"""python -m pretrain --config FILE [key=value ...]

Pretrain an image encoder with a self-supervised method (and optional hard view selection). Runs in one
process as it is, or in several under `torchrun --nproc-per-node N -m pretrain ...` / `deepspeed`.
Starting a run whose directory holds a checkpoint resumes it. SIGINT / SIGTERM (Ctrl-C, scancel), SIGUSR2
and SIGUSR1 (a scheduler's time-limit warning) finish the optimizer step under way, save a checkpoint and exit; a second
SIGINT / SIGTERM exits at once.

Exit status: 0 done; 1 training diverged (NaN / inf; the last finite checkpoint is kept); 2 bad input, nothing
trained (config, data, checkpoint, run directory in use, disk full); 128 + N stopped by signal N after
saving a checkpoint (rerun the same command to resume).
"""
from __future__ import annotations

import argparse
import sys

from omegaconf import OmegaConf

from pretrain.config import ConfigError, load_config
from pretrain.data import DatasetError
from pretrain.runtime.argument_types import CommandLineParser
from pretrain.runtime.checkpoint import CheckpointError
from pretrain.runtime.exit_status import exit_status_of
from pretrain.runtime.memory_reuse import reuse_freed_memory
from pretrain.runtime.run_lock import RunDirectoryInUse


def main(argv: list[str] | None = None) -> int:
    parser = CommandLineParser(
        prog="python -m pretrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  python -m pretrain --config configs/pretrain/simclr_digits.yaml hvs.enabled=true\n"
               "  torchrun --nproc-per-node 2 -m pretrain --config configs/pretrain/simsiam_digits.yaml "
               "engine.zero_stage=2\n"
               "Every key and its default is in pretrain/config.py (optim.* and engine.*: pretrain/runtime/config.py).")
    parser.add_argument("--config", help="YAML file under configs/pretrain/ (omit to use the schema defaults)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    # The deepspeed launcher passes --local_rank; the process group reads LOCAL_RANK from the environment.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. optim.epochs=5")
    args = parser.parse_args(argv)
    # with HARDVIEW_MALLOC=reuse: freed memory kept for the next batch (pretrain/runtime/memory_reuse.py)
    reuse_freed_memory()
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    if args.print_config:
        print(OmegaConf.to_yaml(cfg))
        return 0
    # heavy: the training (deepspeed, timm, torchvision, tensorboard: about 2 s), which --help and --print-config
    # do not need
    from pretrain.pretraining import train
    from pretrain.runtime.monitor import MetricsFileError

    return exit_status_of(lambda: train(cfg),
                        (ConfigError, DatasetError, CheckpointError, RunDirectoryInUse, MetricsFileError), "training")


if __name__ == "__main__":
    sys.exit(main())
