"""`python -m pretrain.bench gpu`: training images/s and views/s per GPU at ImageNet sizes, the loader feeding
JPEGs (needs CUDA)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from pretrain.bench.images import synthetic_photo_folder

GPU_ANCHORS = ("NVIDIA's ResNet-50 mixed-precision training: about 2,470 images/s per A100; "
               "FFCV's ResNet-50: about 3,000 images/s per A100")


def gpu_variants(batch_simclr: int, batch_dino: int) -> list[tuple[str, str, list[str]]]:
    """(name, config, overrides) of the measured runs: SimCLR ResNet-50 224 px and DINO ViT-S/16 multi-crop, each
    without and with hard view selection, bf16, channels-last for the ResNet."""
    simclr = ["engine.precision=bf16", "engine.channels_last=true", f"data.batch_size={batch_simclr}"]
    dino = ["engine.precision=bf16", f"data.batch_size={batch_dino}"]
    return [("SimCLR R50 2x224", "configs/pretrain/simclr_imagenet_folder.yaml", simclr),
            ("SimCLR R50 2x224, HVS of 4", "configs/pretrain/simclr_imagenet_folder.yaml",
             [*simclr, "hvs.enabled=true", "hvs.num_views=[4]"]),
            ("DINO ViT-S/16 2x224+8x96", "configs/pretrain/dino_vit_small_imagenet_folder.yaml", dino),
            ("DINO ViT-S/16, HVS [2,2,16], 128 cand.", "configs/pretrain/dino_vit_small_imagenet_folder.yaml",
             [*dino, "hvs.enabled=true"])]


def run_gpu_benchmark(args: argparse.Namespace) -> dict:
    # heavy: omegaconf, cv2, for this benchmark only (see pretrain/bench/__init__.py)
    from pretrain.config import load_config

    if not torch.cuda.is_available():
        print("error: no CUDA GPU is visible (torch.cuda.is_available() is False): `python -m pretrain.bench gpu` "
              "measures training throughput per GPU; run it on a machine with one (`make gpu-check` runs it after "
              "the GPU tests)", file=sys.stderr)
        raise SystemExit(2)
    # heavy: cv2, for this benchmark only (see pretrain/bench/__init__.py)
    from pretrain.data.writer import write_image_folder

    work_dir = Path(args.data_dir)
    folder = synthetic_photo_folder(work_dir / f"photos-{args.images}", args.images)
    beton = work_dir / f"photos-{args.images}.beton"
    if not beton.exists():
        write_image_folder(folder, beton, workers=args.workers)
    rows = []
    for name, config, overrides in gpu_variants(args.batch_size_simclr, args.batch_size_dino):
        run_dir = Path(args.out).parent / "gpu_runs" / name.split(",")[0].replace(" ", "_") / str(len(rows))
        shutil.rmtree(run_dir, ignore_errors=True)
        command = [sys.executable, "-m", "pretrain", "--config", config, *overrides, f"run_dir={run_dir}",
                   f"data.train={beton}", f"data.val={beton}", f"data.num_workers={args.workers}",
                   f"engine.max_steps={args.warmup + args.steps}", "engine.checkpoint_every_steps=0",
                   "engine.image_grid_every_steps=0", "engine.log_every_steps=1", "optim.warmup_epochs=0"]
        print("$", " ".join(command), flush=True)
        subprocess.run(command, check=True)
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][args.warmup:]
        cfg = load_config(run_dir / "config.yaml")
        trained = sum(group.count for group in cfg.data.views)
        drawn = sum(cfg.hvs.num_views) if cfg.hvs.enabled else trained
        images = float(np.median([line["perf/images_per_s"] for line in lines]))
        rows.append({"variant": name, "images_per_s_per_gpu": round(images, 1),
                     "trained_views_per_s": round(images * trained, 1), "drawn_views_per_s": round(images * drawn, 1),
                     "data_wait_frac": round(float(np.mean([line["perf/data_wait_frac"] for line in lines])), 3),
                     "batch_per_gpu": cfg.data.batch_size})
    gpu = torch.cuda.get_device_name(0)
    print(f"\n{gpu}, bf16, one process, median of {args.steps} steps after {args.warmup} (loader: {args.workers} "
          "workers, synthetic photo JPEGs ~400 x 350 px q90)")
    print(f"{'variant':<42}{'images/s':>10}{'views/s':>10}{'drawn views/s':>15}{'data wait':>11}")
    for row in rows:
        print(f"{row['variant']:<42}{row['images_per_s_per_gpu']:>10.0f}{row['trained_views_per_s']:>10.0f}"
              f"{row['drawn_views_per_s']:>15.0f}{100 * row['data_wait_frac']:>10.0f}%")
    print(f"anchors: {GPU_ANCHORS}")
    return {"command": "gpu", "device": gpu, "torch": torch.__version__, "rows": rows, "anchors": GPU_ANCHORS}


def add_gpu_command(commands) -> None:
    parser = commands.add_parser("gpu", help="training images/s and views/s per GPU at ImageNet sizes (needs CUDA)",
                                 description="Runs `python -m pretrain` for SimCLR ResNet-50 224 px and DINO ViT-S/16 "
                                             "multi-crop, with and without hard view selection, bf16, on synthetic "
                                             "~400 x 350 px JPEGs through the FFCV loader, and prints images/s and "
                                             "views/s per GPU and the share of each step spent waiting for data.")
    parser.add_argument("--images", type=int, default=20000, help="synthetic JPEGs written once (default: 20000)")
    parser.add_argument("--batch-size-simclr", type=int, default=256, help="per GPU (default: 256)")
    parser.add_argument("--batch-size-dino", type=int, default=64, help="per GPU (default: 64, the paper's 512 / 8)")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="loader threads (default: the cores but one)")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per variant (default: 50)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first (default: 20)")
    parser.add_argument("--data-dir", default="bench/data", help="where the synthetic images are cached")
    parser.add_argument("--out", default="bench/gpu.json", help="where the JSON result goes")
    parser.set_defaults(run=run_gpu_benchmark)
