"""Benchmarks: `python -m pretrain.bench loader|hvs [options]`. Each prints a table and writes JSON.

`loader` measures images/s of the FFCV N-view loader against the torchvision DataLoader path on the same
64 px JPEGs (an image folder and the .beton written from it), N = 2 and 4 views of 32 px, SimCLR recipe
(RandomResizedCrop scale 0.2-1, flip, colour jitter p=0.8 (0.4, 0.4, 0.4, 0.1), grayscale p=0.2), after one
warm-up epoch (numba compilation, worker start, page cache). Prints a table and writes JSON.
`hvs` times the real training step (DeepSpeed engine, method, selection pass) with hard view selection
(N=4, at full and at half resolution) over the step without (N=2), same batch, as ratios from one run.
Add a sub-command by writing `add_<name>_command(commands)` and calling it in `build_parser`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

SIMCLR_SIDE = 32
SOURCE_SIDE = 64


def synthetic_image_folder(root: Path, count: int, side: int = SOURCE_SIDE) -> Path:
    """`count` real-looking side x side JPEGs in 10 class folders: the digits upsampled, tinted, on a colour
    gradient (so colour jitter and crops act on real structure). Reused when already complete."""
    from PIL import Image

    from pretrain.data.digits import digits_images

    marker = root / f".complete-{count}-{side}"
    if marker.exists():
        return root
    images, labels = digits_images(side)
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 1, side, dtype=np.float32)
    for i in range(count):
        digit = images[i % len(images)].astype(np.float32) / 255
        ink, paper_a, paper_b = rng.uniform(0, 1, (3, 3)).astype(np.float32)
        paper = paper_a[None, None] * ramp[:, None, None] + paper_b[None, None] * (1 - ramp[None, :, None])
        picture = digit * ink[None, None] + (1 - digit) * paper
        folder = root / f"class{labels[i % len(images)]}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((picture * 255).astype(np.uint8)).save(folder / f"{i:06d}.jpg", quality=90)
    marker.touch()
    return root


def synthetic_photo_folder(root: Path, count: int) -> Path:
    """`count` photo-sized JPEGs (about 400 x 350 px, landscape and portrait, quality 90) in 10 class folders:
    a large digit in a random colour over a colour gradient, band-limited texture and sensor-like noise, so
    that a JPEG costs about what a photo of that size costs to decode (tens of KB, not a few). Reused when
    already complete."""
    from PIL import Image

    from pretrain.data.digits import digits_images

    marker = root / f".complete-{count}"
    if marker.exists():
        return root
    digits, labels = digits_images(64)
    rng = np.random.default_rng(0)
    for i in range(count):
        width, height = int(rng.integers(360, 460)), int(rng.integers(300, 400))
        if rng.random() < 0.25:
            width, height = height, width
        y, x = np.mgrid[0:height, 0:width].astype(np.float32)
        a, b = rng.uniform(0, 1, (2, 3)).astype(np.float32)
        picture = a * (x / width)[..., None] + b * (y / height)[..., None]
        for _ in range(4):                                   # band-limited texture
            fx, fy, phase = rng.uniform(0.01, 0.15), rng.uniform(0.01, 0.15), rng.uniform(0, 6.3)
            picture += 0.08 * np.sin(fx * x + fy * y + phase)[..., None] * rng.uniform(-1, 1, 3).astype(np.float32)
        side = int(rng.integers(min(width, height) // 3, min(width, height)))
        digit = np.asarray(Image.fromarray(digits[i % len(digits)]).resize((side, side)), dtype=np.float32) / 255
        top, left = int(rng.integers(0, height - side + 1)), int(rng.integers(0, width - side + 1))
        ink = rng.uniform(0, 1, 3).astype(np.float32)
        region = picture[top:top + side, left:left + side]
        picture[top:top + side, left:left + side] = digit * ink + (1 - digit) * region
        picture += rng.normal(0, 0.03, picture.shape).astype(np.float32)
        folder = root / f"class{labels[i % len(digits)]}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((picture.clip(0, 1) * 255).astype(np.uint8)).save(folder / f"{i:06d}.jpg", quality=90)
    marker.touch()
    return root


def cpu_seconds() -> float:
    """CPU time of this process (all threads) plus its reaped children (DataLoader workers exit per epoch)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def images_per_second(loader, epochs: int = 3) -> tuple[float, float]:
    """(images per wall second, images per CPU second) of the fastest of `epochs` epochs after one warm-up
    epoch; every view is computed. The fastest epoch is the one least disturbed by other processes; the
    CPU-second rate is on an idle machine with C cores at least 1/C of the wall rate.
    """
    for batch in loader.epoch(0):
        pass
    best = (0.0, 0.0)
    for epoch in range(1, epochs + 1):
        images, start, start_cpu = 0, time.perf_counter(), cpu_seconds()
        for batch in loader.epoch(epoch):
            images += batch.batch_size
            float(batch.views[0][0, 0, 0, 0, 0])      # on CUDA: wait for the work to finish
        rate = images / (time.perf_counter() - start)
        if rate > best[0]:
            best = (rate, images / (cpu_seconds() - start_cpu))
    return best


def run_loader_benchmark(args: argparse.Namespace) -> dict:
    from pretrain.data.loader import build_view_loader
    from pretrain.data.views import ViewGroup
    from pretrain.data.writer import write_image_folder

    work_dir = Path(args.data_dir)
    folder = synthetic_image_folder(work_dir / f"images-{args.images}", args.images)
    beton = work_dir / f"images-{args.images}.beton"
    if not beton.exists():
        write_image_folder(folder, beton, workers=args.workers)
    torch.set_num_threads(args.workers)
    print(f"1-minute load average before: {os.getloadavg()[0]:.2f}")
    rows = []
    for views in args.views:
        groups = [ViewGroup(count=views, size=SIMCLR_SIDE)]
        for backend, path, canvas in (("ffcv", beton, SOURCE_SIDE), ("ffcv", beton, SIMCLR_SIDE),
                                      ("torchvision", folder, None)):
            loader = build_view_loader(path, groups, args.batch_size, backend=backend, device=args.device,
                                       canvas_size=canvas or SOURCE_SIDE, num_workers=args.workers)
            rate, cpu_rate = images_per_second(loader, args.epochs)
            del loader
            rows.append({"backend": backend, "canvas": canvas, "views": views, "images_per_s": round(rate, 1),
                         "images_per_cpu_s": round(cpu_rate, 1), "views_per_s": round(rate * views, 1)})
            print(f"  {backend:<12} canvas={str(canvas):<5} N={views}: {rate:9.1f} images/s, "
                  f"{cpu_rate:9.1f} images/CPU-s", flush=True)
    result = {"command": "loader", "images": args.images, "batch_size": args.batch_size, "workers": args.workers,
              "device": args.device, "source_px": SOURCE_SIDE, "view_px": SIMCLR_SIDE, "epochs_timed": args.epochs,
              "torch": torch.__version__, "python": platform.python_version(), "rows": rows}
    result["load_average_1min"] = os.getloadavg()[0]
    for metric, label in (("images_per_s", "images / wall second"), ("images_per_cpu_s", "images / CPU second")):
        by_key = {(r["backend"], r["canvas"], r["views"]): r[metric] for r in rows}
        print(f"\n{label}\n{'backend':<12}{'canvas':>8}{'N=2':>10}{'N=4':>10}{'vs torchvision N=2/N=4':>26}"
              f"{'N=4 cost / N=2':>16}")
        for backend, canvas in (("ffcv", SOURCE_SIDE), ("ffcv", SIMCLR_SIDE), ("torchvision", None)):
            if (backend, canvas, 2) not in by_key or (backend, canvas, 4) not in by_key:
                continue
            two, four = by_key[(backend, canvas, 2)], by_key[(backend, canvas, 4)]
            speedup = (f"{two / by_key[('torchvision', None, 2)]:.1f}x / "
                       f"{four / by_key[('torchvision', None, 4)]:.1f}x")
            print(f"{backend:<12}{str(canvas or '-'):>8}{two:>10.0f}{four:>10.0f}{speedup:>26}{two / four:>16.2f}")
    print(f"\n1-minute load average at the end: {result['load_average_1min']:.2f} "
          f"(> {args.workers} means other processes shared the cores: trust images / CPU second)")
    return result


def add_loader_command(commands) -> None:
    loader = commands.add_parser("loader", help="FFCV N-view loader vs torchvision DataLoader, images/s.",
                                 description="Measure images/s of the FFCV N-view loader and the torchvision path "
                                             "on the same synthetic 64 px JPEGs, N = 2 and 4 views of 32 px.")
    loader.add_argument("--images", type=int, default=4000, help="Number of synthetic images. Default: 4000.")
    loader.add_argument("--batch-size", type=int, default=256, help="Images per batch. Default: 256.")
    loader.add_argument("--workers", type=int, default=2,
                        help="FFCV threads / DataLoader worker processes / torch threads. Default: 2.")
    loader.add_argument("--epochs", type=int, default=3,
                        help="Timed epochs after the warm-up epoch; the fastest is reported. Default: 3.")
    loader.add_argument("--views", type=int, nargs="+", default=[2, 4], help="View counts N to time. Default: 2 4.")
    loader.add_argument("--device", default="cpu", help="Device the views are made on (cpu, cuda). Default: cpu.")
    loader.add_argument("--data-dir", default="bench/data", help="Where the synthetic images are cached. "
                                                                 "Default: bench/data.")
    loader.add_argument("--out", default="bench/loader.json", help="JSON result file. Default: bench/loader.json.")
    loader.set_defaults(run=run_loader_benchmark)


# ==== hvs: training-step time with hard view selection (N=4) over without (N=2) ====

def time_train_steps(cfg, steps: int, warmup: int) -> float:
    """Median seconds of one training step (selection pass included when cfg.hvs.enabled) on fixed
    random views: the model's cost alone, without the loader."""
    import deepspeed

    from pretrain.config import views_to_draw
    from pretrain.engine import deepspeed_config, train_step
    from pretrain.methods import build_method
    from pretrain.optim import build_optimizer

    torch.manual_seed(0)
    method = build_method(cfg)
    optimizer = build_optimizer(cfg, method.param_groups(), cfg.optim.lr)
    engine, _, _, _ = deepspeed.initialize(model=method, optimizer=optimizer, config=deepspeed_config(cfg))
    batch = cfg.data.batch_size
    groups = views_to_draw(cfg)
    views = [torch.randn(batch, g.count, 3, g.size, g.size) for g in groups]
    boxes = [torch.tensor([0.0, 0.0, 1.0, 1.0]).expand(batch, g.count, 4) for g in groups]
    labels = torch.arange(batch) % 10
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        train_step(engine, method, views, boxes, labels, cfg.hvs, random.Random(step))
        times.append(time.perf_counter() - start)
    return float(np.median(times[warmup:]))


def run_hvs_benchmark(args: argparse.Namespace) -> dict:
    from pretrain.config import load_config
    from pretrain.engine import init_distributed

    init_distributed()
    rows = []
    for config in args.configs:
        method = load_config(config).method.name
        common = [f"data.batch_size={args.batch_size}", f"data.views.0.size={args.size}"]
        if method == "simsiam":
            common += ["model.proj_out_dim=512", "model.pred_hidden_dim=128"]
        variants = [("N=2, no selection", ["hvs.enabled=false"]),
                    ("N=4, HVS", ["hvs.enabled=true", "hvs.num_views=[4]"]),
                    (f"N=4, HVS, selection at {args.size // 2} px",
                     ["hvs.enabled=true", "hvs.num_views=[4]", f"hvs.selection_size={args.size // 2}"])]
        baseline = None
        for name, overrides in variants:
            cfg = load_config(config, common + overrides)
            seconds = time_train_steps(cfg, args.steps, args.warmup)
            baseline = baseline or seconds
            rows.append({"method": method, "variant": name, "step_s": seconds, "ratio": seconds / baseline})
    print(f"\ntraining-step time, batch {args.batch_size}, {args.size} px, "
          f"median of {args.steps} steps ({torch.get_num_threads()} threads)")
    print(f"{'method':<9}{'variant':<34}{'step (s)':>10}{'x N=2':>8}")
    for row in rows:
        print(f"{row['method']:<9}{row['variant']:<34}{row['step_s']:>10.3f}{row['ratio']:>8.2f}")
    result = {"configs": args.configs, "batch_size": args.batch_size, "size": args.size, "rows": rows}
    return result


def add_hvs_command(commands) -> None:
    parser = commands.add_parser(
        "hvs", help="training-step time with hard view selection (N=4) over without (N=2), same batch",
        description="Times the real training step (DeepSpeed engine, method, selection pass) on fixed random "
                    "views, with and without hard view selection, and prints the ratio measured in one run.")
    parser.add_argument("--configs", nargs="+", help="pair-method configs to time (one view group of 2)",
                        default=["configs/pretrain/simclr_digits.yaml", "configs/pretrain/simsiam_digits.yaml"])
    parser.add_argument("--batch-size", type=int, default=128, help="images per step")
    parser.add_argument("--size", type=int, default=16, help="view side in pixels")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (allocator, oneDNN warm-up)")
    parser.add_argument("--out", default="bench/hvs.json", help="where the JSON result goes")
    parser.set_defaults(run=run_hvs_benchmark)


# ==== gpu: training throughput per GPU at ImageNet sizes, the loader feeding real JPEGs ====

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
    import subprocess

    from pretrain.config import load_config

    if not torch.cuda.is_available():
        print("error: no CUDA GPU is visible (torch.cuda.is_available() is False): `python -m pretrain.bench gpu` "
              "measures training throughput per GPU; run it on a machine with one (`make gpu-check` runs it after "
              "the GPU tests)", file=sys.stderr)
        raise SystemExit(2)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pretrain.bench", description="Pretraining benchmarks.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_loader_command(commands)
    add_hvs_command(commands)
    add_gpu_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = args.run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
