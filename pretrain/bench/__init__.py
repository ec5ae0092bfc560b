"""Benchmarks: `python -m pretrain.bench loader|hvs|gpu|gpu-check|peers|train|precision|storage|workers [options]`. Each prints a table and writes JSON.

`loader` measures images/s of the FFCV N-view loader against the torchvision DataLoader path on the same
64 px JPEGs (an image folder and the .beton written from it), N = 2 and 4 views of 32 px, SimCLR recipe
(RandomResizedCrop scale 0.2-1, flip, colour jitter p=0.8 (0.4, 0.4, 0.4, 0.1), grayscale p=0.2), after one
warm-up epoch (numba compilation, worker start, page cache). Prints a table and writes JSON.
`loader --sizes imagenet` cuts JPEGs of ImageNet's sizes from real photographs and compares, per 224 px recipe,
decode once (this project), one decode per view (FFCV-SSL's way) and torchvision, each case in a process of its
own: (1) the CPU time per image of a GPU run's host side (device "meta": the device work left out), as CPU
cores per GPU, and (2) images per CPU second when everything runs on the CPU.
`hvs` times the real training step (DeepSpeed engine, method, selection pass) with hard view selection
(N=4, at full and at half resolution) over the step without (N=2), same batch, as ratios from one run.
`peers` compares this project with lightly at equal settings on Fashion-MNIST (accuracy per epoch, images/s).
`train` times the whole pretraining step against a plain PyTorch loop of the same model, splits it by phase, and
runs it on 2 processes and beside busy ones.
`precision` times the same ResNet-18 step in fp32 and under bf16 autocast in alternating rounds, on this CPU.
`gpu-check` runs tests/gpu, `train` at ImageNet sizes and `gpu` in at most 8 minutes on a GPU (`--dry-run`: checks
its parts on the CPU, in `make test`).
`storage` weighs the stored forms of ImageNet-sized photographs (`pretrain.data write --max-side`, JPEG
quality or raw): bytes per image, the GPU run's host time per image, and the PSNR of their views against the
same crops of the originals.
`workers` times an epoch of the torchvision backend's workers started from the forkserver against forked ones.
One module per benchmark (loader, hvs, gpu, peers, train, precision, storage, workers), each with its `add_<name>_command(commands)`, called in
`build_parser`; images.py makes the images they read.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

# Every benchmark module is imported here, for the parser: what they import at their top, every bench command
# (and --help) pays. The project's training modules (pretrain.config, the loaders, methods, the loop: omegaconf,
# cv2, FFCV, timm, deepspeed) are imported inside the function of the benchmark that uses them ("heavy:").
from pretrain.bench.gpu import add_gpu_command
from pretrain.bench.gpu_check import add_gpu_check_command
from pretrain.bench.hvs import add_hvs_command
from pretrain.bench.loader import add_loader_command
from pretrain.bench.peers import add_peers_command
from pretrain.bench.precision import add_precision_command
from pretrain.bench.storage import add_storage_command
from pretrain.bench.train import add_train_command
from pretrain.bench.workers import add_workers_command
from pretrain.runtime.argument_types import CommandLineParser
from pretrain.runtime.memory_reuse import reuse_freed_memory


def build_parser() -> argparse.ArgumentParser:
    parser = CommandLineParser(prog="python -m pretrain.bench", description="Pretraining benchmarks.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_loader_command(commands)
    add_hvs_command(commands)
    add_gpu_command(commands)
    add_gpu_check_command(commands)
    add_peers_command(commands)
    add_train_command(commands)
    add_precision_command(commands)
    add_storage_command(commands)
    add_workers_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    reuse_freed_memory()           # as `python -m pretrain` does (pretrain/runtime/memory_reuse.py)
    result = args.run(args)
    if args.out is None:
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0
