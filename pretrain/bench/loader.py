"""`python -m pretrain.bench loader`: images/s of the FFCV N-view loader against the torchvision DataLoader path on
the same JPEGs; with `--sizes imagenet`, decode once (this project) vs one decode per view (FFCV-SSL's way) vs
torchvision at ImageNet's sizes, each case in a process of its own."""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from pretrain.bench.images import (PHOTO_SIZES, PHOTO_SOURCE, SIMCLR_SIDE, SOURCE_SIDE, benchmark_images,
                                   synthetic_image_folder)
from pretrain.data.seeding import seeded_generator
from pretrain.data.views import ViewBatch, ViewGroup
from pretrain.runtime.argument_types import non_negative_int, positive_int

def cpu_seconds() -> float:
    """CPU time of this process (all threads) plus its reaped children (DataLoader workers exit per epoch)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def images_per_second(loader, epochs: int = 3) -> tuple[float, float]:
    """(images per wall second, images per CPU second) after one warm-up epoch; every view is computed. The wall
    rate is the fastest of `epochs` epochs (the one least disturbed by other processes); the CPU rate is over all
    of them (CPU time is what other processes disturb least, and short epochs vary). On an idle machine with C
    cores the CPU rate is at least 1/C of the wall rate.
    """
    for batch in loader.epoch(0):
        pass
    best, images, cpu = 0.0, 0, 0.0
    for epoch in range(1, epochs + 1):
        count, start, start_cpu = 0, time.perf_counter(), cpu_seconds()
        for batch in loader.epoch(epoch):
            count += batch.batch_size
            if batch.views[0].device.type != "meta":      # meta: no device work to wait for
                float(batch.views[0][0, 0, 0, 0, 0])      # on CUDA: wait for the work to finish
        best = max(best, count / (time.perf_counter() - start))
        images, cpu = images + count, cpu + cpu_seconds() - start_cpu
    return best, images / cpu


def run_loader_benchmark(args: argparse.Namespace) -> dict:
    if args.images < args.batch_size:       # every epoch would be empty (whole batches only): nothing to time
        print(f"error: --images {args.images} is fewer than --batch-size {args.batch_size}: an epoch holds whole "
              "batches only; raise --images or lower --batch-size", file=sys.stderr)
        raise SystemExit(2)
    if args.sizes == "imagenet":
        return run_imagenet_loader_benchmark(args)
    # heavy: cv2, for this benchmark only (see pretrain/bench/__init__.py)
    from pretrain.data.loader import build_view_loader
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
    loader.add_argument("--images", type=positive_int, default=4000, help="Number of synthetic images. Default: 4000.")
    loader.add_argument("--batch-size", type=positive_int, default=256, help="Images per batch. Default: 256.")
    loader.add_argument("--workers", type=positive_int, default=2,
                        help="FFCV threads / DataLoader worker processes / torch threads. Default: 2.")
    loader.add_argument("--epochs", type=positive_int, default=3,
                        help="Timed epochs after the warm-up epoch; the fastest is reported. Default: 3.")
    loader.add_argument("--views", type=positive_int, nargs="+", default=[2, 4],
                        help="View counts N to time. Default: 2 4.")
    loader.add_argument("--device", default="cpu", help="Device the views are made on (cpu, cuda). Default: cpu.")
    loader.add_argument("--data-dir", default="bench/data", help="Where the synthetic images are cached. "
                                                                 "Default: bench/data.")
    loader.add_argument("--out", default="bench/loader.json", help="JSON result file. Default: bench/loader.json.")
    loader.add_argument("--sizes", choices=("digits", "imagenet"), default="digits",
                        help="digits: 64 px JPEGs -> 32 px views (the default); imagenet: photograph JPEGs (--photos, "
                             "--photo-size) -> SimCLR 2x224 / 4x224 and DINO 2x224+6x96 / 4x224+16x96, decode once vs "
                             "one decode per view vs torchvision, each in a process of its own (memory): the host's CPU "
                             "time per image in a GPU run (cores per GPU), images per CPU second on the CPU, and a "
                             "profile")
    loader.add_argument("--canvas", type=non_negative_int, default=0,
                        help="imagenet: the decode-once canvas side, or 0 for views cut from the decoded image itself "
                             "(data.canvas_size of the ImageNet configs). Default: 0.")
    loader.add_argument("--canvas-sweep", type=non_negative_int, nargs="*", default=[384],
                        help="imagenet: further canvases to time for SimCLR and DINO, on the CPU and on the GPU "
                             "path's host side. Default: 384.")
    loader.add_argument("--recipes", nargs="+", choices=tuple(imagenet_recipes()), default=tuple(imagenet_recipes()),
                        metavar="RECIPE", help=f"imagenet: the recipes to time, of {', '.join(imagenet_recipes())}. "
                                               "Default: all.")
    loader.add_argument("--photos", default=str(PHOTO_SOURCE),
                        help="imagenet: a folder of photographs the JPEGs are cut from, or 'generated' for the "
                             f"generated images (the fallback when the folder is missing). Default: {PHOTO_SOURCE} "
                             "(`apt-get install mate-backgrounds`).")
    loader.add_argument("--photo-size", choices=tuple(PHOTO_SIZES), default="400x350",
                        help="imagenet: the JPEGs' size, ImageNet's typical or its largest. Default: 400x350.")
    loader.set_defaults(run=run_loader_benchmark)
    case = commands.add_parser("loader-case", help="one case of `bench loader`, measured in a process of its "
                                                    "own (`bench loader` runs it; not for use by hand)")
    case.add_argument("--case", required=True, help="the case's name, as `bench loader` names it")
    case.add_argument("--batch-size", type=positive_int, default=64, help="images per batch. Default: 64.")
    case.add_argument("--workers", type=positive_int, default=2, help="loader workers. Default: 2.")
    case.add_argument("--epochs", type=positive_int, default=2, help="epochs timed. Default: 2.")
    case.set_defaults(run=lambda args: print(json.dumps(run_loader_case(args))) or {}, out=None)


# ==== loader at ImageNet sizes: decode once vs one decode per view vs torchvision, in processes of their own ====

def imagenet_recipes() -> dict[str, list]:
    """The view recipes users train with at 224 px, as `data.views` groups (configs/pretrain/*imagenet*)."""
    simclr = dict(size=224, scale=(0.08, 1.0), brightness=0.8, contrast=0.8, saturation=0.8, hue=0.2, blur_p=0.5)
    glob = dict(size=224, scale=(0.4, 1.0), brightness=0.4, contrast=0.4, saturation=0.2, hue=0.1)
    local = dict(size=96, scale=(0.05, 0.4), brightness=0.4, contrast=0.4, saturation=0.2, hue=0.1, blur_p=0.5)

    def dino(globals_per_kind: int, locals_: int) -> list:
        return [ViewGroup(count=globals_per_kind, blur_p=1.0, **glob),
                ViewGroup(count=globals_per_kind, blur_p=0.1, solarize_p=0.2, **glob),
                ViewGroup(count=locals_, **local)]
    return {"SimCLR 2x224": [ViewGroup(count=2, **simclr)], "SimCLR HVS 4x224": [ViewGroup(count=4, **simclr)],
            "DINO 2x224+6x96": dino(1, 6), "DINO HVS 4x224+16x96": dino(2, 16)}


class DecodePerViewLoader:
    """FFCV-SSL's way, emulated with the registry's FFCV: one FFCV pipeline per view over the same .beton, each
    decoding the whole JPEG again and cropping its view (FFCV's RandomResizedCropRGBImageDecoder) on the host;
    then each view goes to `device` as the decode-once canvas does (`canvas_to_device`) and is flipped, coloured,
    blurred and normalised there by the same torch code. Iterated in lockstep: a batch holds every view."""

    def __init__(self, path: Path, groups: list, batch_size: int, num_workers: int, seed: int = 0,
                 device: str = "cpu"):
        # heavy: ffcv, for this benchmark only (see pretrain/bench/__init__.py)
        from ffcv.fields.basics import IntDecoder
        from ffcv.fields.rgb_image import RandomResizedCropRGBImageDecoder
        from ffcv.loader import OrderOption
        from ffcv.transforms import ToTensor

        from pretrain.data.ffcv_loader import ReorderableLoader

        self.groups = groups
        self.device = torch.device(device)
        self.loaders = []
        for group in groups:
            for _ in range(group.count):
                pipelines = {"image": [RandomResizedCropRGBImageDecoder((group.size, group.size), group.scale,
                                                                        group.ratio), ToTensor()],
                             "label": [IntDecoder(), ToTensor()], "index": None, "height": None, "width": None}
                self.loaders.append(ReorderableLoader(str(path), batch_size=batch_size, num_workers=num_workers,
                                                      order=OrderOption.SEQUENTIAL, pipelines=pipelines,
                                                      drop_last=True, indices=np.arange(1, dtype=np.uint64)))
        # flip + colour of a view that is already cropped: the whole crop, resized to itself
        self.finish = [replace(group, count=1, scale=(1.0, 1.0), ratio=(1.0, 1.0)) for group in groups]
        self.seed = seed
        self.num_images = int(self.loaders[0].reader.num_samples)

    def epoch(self, epoch: int):
        # heavy: ffcv, cv2, for this benchmark only (see pretrain/bench/__init__.py)
        from pretrain.data.augment import augment_group, canvas_to_device, normalise
        from pretrain.data.ffcv_loader import ffcv_batches
        from pretrain.data.loader import IMAGENET_MEAN, IMAGENET_STD

        order = torch.randperm(self.num_images, generator=seeded_generator(self.seed, epoch)).numpy()
        streams = [ffcv_batches(loader, order) for loader in self.loaders]
        for step, crops in enumerate(zip(*streams)):
            generator = seeded_generator(self.seed, epoch, step)
            views, k = [], 0
            for group, finish in zip(self.groups, self.finish):
                side = torch.tensor([[group.size, group.size]]).expand(crops[k][0].shape[0], 2)
                drawn = [augment_group(canvas_to_device(crops[k + i][0], self.device), side, finish, generator,
                                       1 / 255)[0] for i in range(group.count)]
                views.append(normalise(torch.cat(drawn, dim=1), IMAGENET_MEAN, IMAGENET_STD))
                k += group.count
            yield ViewBatch(views=views, boxes=[], labels=crops[0][1], indices=crops[0][1])


def upsampled_share(groups: list, canvas: int | None, source_hw=(350, 400), draws: int = 20000) -> float:
    """Share of the recipe's views whose crop covers fewer canvas pixels than the view has (on either side): the
    view is then upsampled, blurrier than the source allows. canvas None: the source image's own pixels."""
    # heavy: cv2, for this benchmark only (see pretrain/bench/__init__.py)
    from pretrain.data.augment import sample_crop_boxes

    upsampled, total = 0, 0
    for group in groups:
        hw = torch.tensor([source_hw], dtype=torch.float64).expand(draws, 2)
        boxes = sample_crop_boxes(hw, group.scale, group.ratio, torch.Generator().manual_seed(0))
        height, width = (canvas, canvas) if canvas else source_hw
        small = ((boxes[:, 3] - boxes[:, 1]) * height < group.size) | ((boxes[:, 2] - boxes[:, 0]) * width < group.size)
        upsampled += int(small.sum()) * group.count
        total += draws * group.count
    return upsampled / total


def run_loader_case(args: argparse.Namespace) -> dict:
    """One case in this process (a process of its own per case, so that its memory is its own). Device "meta":
    the host's share of a GPU run, the device work left out (`canvas_to_device`)."""
    # heavy: cv2, for this benchmark only (see pretrain/bench/__init__.py)
    from pretrain.data.loader import build_view_loader

    case = json.loads(args.case)
    groups = imagenet_recipes()[case["recipe"]]
    torch.set_num_threads(args.workers)
    device = case.get("device", "cpu")
    if case["loader"] == "decode once":
        loader = build_view_loader(case["beton"], groups, args.batch_size, canvas_size=case["canvas"],
                                   num_workers=args.workers, device=device)
    elif case["loader"] == "decode per view":
        loader = DecodePerViewLoader(Path(case["beton"]), groups, args.batch_size, args.workers, device=device)
    else:
        loader = build_view_loader(case["folder"], groups, args.batch_size, backend="torchvision",
                                   num_workers=args.workers)
    epochs = 4 * args.epochs if device == "meta" else args.epochs     # a host-side epoch takes a fraction of a second
    rate, cpu_rate = images_per_second(loader, epochs)
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {**case, "images_per_s": round(rate, 1), "images_per_cpu_s": round(cpu_rate, 1),
            "views_per_s": round(rate * sum(g.count for g in groups), 1), "peak_rss_mb": round(own),
            "largest_worker_rss_mb": round(workers)}


def run_case_in_own_process(case: dict, batch_size: int, workers: int, epochs: int) -> dict:
    """`run_loader_case` in a fresh Python process (`python -m pretrain.bench loader-case`): the case's memory and
    numba compilation are its own, and no earlier case's threads or page faults are counted. Returns its row."""
    finished = subprocess.run([sys.executable, "-m", "pretrain.bench", "loader-case", "--case", json.dumps(case),
                               "--batch-size", str(batch_size), "--workers", str(workers), "--epochs", str(epochs)],
                              capture_output=True, text=True)
    if finished.returncode:
        raise SystemExit(f"error: the case {json.dumps(case)} failed:\n{finished.stderr[-3000:]}")
    return json.loads(finished.stdout.strip().splitlines()[-1])


def profile_views(beton: Path, groups: list, canvas: int, batch_size: int, workers: int) -> list[tuple[str, float]]:
    """Where a decode-once batch's time goes on this device: FFCV's decode to canvases, then the torch ops that
    draw the views (top operators by self CPU time), per batch."""
    # heavy: ffcv, cv2, for this benchmark only (see pretrain/bench/__init__.py)
    from pretrain.data.augment import augment_views
    from pretrain.data.ffcv_loader import build_ffcv_loader, ffcv_batches

    torch.set_num_threads(workers)
    loader = build_ffcv_loader(beton, canvas, batch_size, workers, drop_last=True)
    order = np.arange(min(len(loader.reader.alloc_table), 8 * batch_size))
    list(ffcv_batches(loader, order))                                    # warm-up (numba compilation)
    start = time.perf_counter()
    batches = [(b[0], torch.stack([b[3], b[4]], 1)) for b in ffcv_batches(loader, order)]
    decode_ms = 1000 * (time.perf_counter() - start) / len(batches)
    generator = torch.Generator().manual_seed(0)
    augment_views(batches[0][0], batches[0][1], groups, (0.5,) * 3, (0.25,) * 3, generator,
                  None if canvas else batches[0][1])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for canvas_, hw in batches:
            augment_views(canvas_, hw, groups, (0.5,) * 3, (0.25,) * 3, generator, None if canvas else hw)
    rows = [("FFCV decode" + (" + stretch to canvas" if canvas else ", the image padded into the batch"), decode_ms)]
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:6]
    rows += [(f"torch {e.key}", e.self_cpu_time_total / 1000 / len(batches)) for e in events]
    return rows


GPU_FEED_RATE = 3000          # images/s one GPU trains ResNet-50 at (FFCV's A100 figure): what its host must feed


def run_imagenet_loader_benchmark(args: argparse.Namespace) -> dict:
    """The cases in processes of their own, then the two figures, the canvas geometry and the profile."""
    folder, beton, described = benchmark_images(Path(args.data_dir), args.images, args.photos, args.photo_size,
                                                args.workers)
    recipes = {name: groups for name, groups in imagenet_recipes().items() if name in args.recipes}
    loaders = ("decode once", "decode per view", "torchvision")
    swept = [r for r in ("SimCLR 2x224", "DINO 2x224+6x96") if r in recipes]
    cases = [{"recipe": r, "loader": loader, "canvas": args.canvas if loader == "decode once" else None,
              "device": "cpu"} for r in recipes for loader in loaders]
    # the host's share of a GPU run; torchvision's is all of its work, the case above
    cases += [{"recipe": r, "loader": loader, "canvas": args.canvas if loader == "decode once" else None,
               "device": "meta"} for r in recipes for loader in loaders[:2]]
    cases += [{"recipe": r, "loader": "decode once", "canvas": c, "device": device}
              for device in ("cpu", "meta") for r in swept for c in args.canvas_sweep if c != args.canvas]
    print(f"{described}\n1-minute load average before: {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    for case in cases:
        row = run_case_in_own_process({**case, "beton": str(beton), "folder": str(folder)}, args.batch_size,
                                      args.workers, args.epochs)
        rows.append(row)
        where = "host side of a GPU run" if row["device"] == "meta" else "on the CPU"
        print(f"  {row['recipe']:<22}{row['loader']:<17}canvas={str(row['canvas']):<5}{where:<24}"
              f"{row['images_per_s']:8.1f} images/s {row['images_per_cpu_s']:8.1f} images/CPU-s  peak RSS "
              f"{row['peak_rss_mb']} MB (workers {row['largest_worker_rss_mb']} MB)", flush=True)

    def rate(recipe, loader, device="cpu", canvas=args.canvas, metric="images_per_cpu_s"):
        device = "cpu" if loader == "torchvision" else device
        return next(r[metric] for r in rows if r["recipe"] == recipe and r["loader"] == loader and r["device"] ==
                    device and (loader != "decode once" or r["canvas"] == canvas))

    views = {recipe: sum(group.count for group in recipes[recipe]) for recipe in recipes}
    print(f"\n1. the host's share of a GPU run: CPU milliseconds per image (views cut, coloured and blurred on the "
          f"device, here a no-op), and CPU cores per GPU to feed {GPU_FEED_RATE:,} images/s; batch {args.batch_size}")
    print(f"{'recipe':<22}{'decode once':>13}{'per view':>10}{'torchvision':>13}{'cores/GPU':>18}"
          f"{'once/per view':>15}{'goal':>7}{'once/tv':>9}{'goal':>6}")
    host = {}
    for recipe in recipes:
        ms = [1000 / rate(recipe, loader, "meta") for loader in loaders]
        host[recipe] = dict(zip(loaders, ms))
        cores = "/".join(f"{GPU_FEED_RATE * m / 1000:.0f}" for m in ms)
        print(f"{recipe:<22}{ms[0]:>13.2f}{ms[1]:>10.2f}{ms[2]:>13.2f}{cores:>18}{ms[0] / ms[1]:>15.2f}"
              f"{'<' + format(1 / views[recipe], '.2f'):>7}{ms[0] / ms[2]:>9.3f}{'<0.1':>6}")
    print(f"\n2. on the CPU: images / CPU second (images / wall second), decode once "
          f"{f'to a {args.canvas} px canvas' if args.canvas else 'to the image itself'}, {args.workers} workers")
    print(f"{'recipe':<22}{'decode once':>18}{'decode per view':>18}{'torchvision':>18}{'once/per view':>15}"
          f"{'once/tv':>9}")
    for recipe in recipes:
        cells = [f"{rate(recipe, l):.0f} ({rate(recipe, l, metric='images_per_s'):.0f})" for l in loaders]
        print(f"{recipe:<22}{cells[0]:>18}{cells[1]:>18}{cells[2]:>18}"
              f"{rate(recipe, 'decode once') / rate(recipe, 'decode per view'):>14.2f}x"
              f"{rate(recipe, 'decode once') / rate(recipe, 'torchvision'):>8.2f}x")
    cost = {loader: {r: 1 / rate(r, loader) for r in recipes} for loader in loaders}
    print("\ncost per image of the larger pool over the recipe it extends, on the CPU (goal for decode once: "
          "4x224 / 2x224 <= 1.5)")
    pools = [(name, pool, base) for name, pool, base in (("4x224 / 2x224", "SimCLR HVS 4x224", "SimCLR 2x224"),
                                                         ("DINO pool / 8 views", "DINO HVS 4x224+16x96",
                                                          "DINO 2x224+6x96")) if pool in recipes and base in recipes]
    print(f"{'loader':<18}" + "".join(f"{name:>22}" for name, _, _ in pools))
    for loader, c in cost.items():
        print(f"{loader:<18}" + "".join(f"{c[pool] / c[base]:>22.2f}" for _, pool, base in pools))
    print("\ncanvas: the share of views upsampled (crop smaller than the view on the canvas; exact geometry), and "
          "images / CPU second on the CPU and on the GPU path's host side where timed")
    for recipe in swept:
        for canvas in sorted({args.canvas, 256, 384, 512, *args.canvas_sweep}):
            timed = {r["device"]: r["images_per_cpu_s"] for r in rows if r["recipe"] == recipe
                     and r["loader"] == "decode once" and r["canvas"] == canvas}
            speed = (f"{timed['cpu']:6.0f} on the CPU, {timed['meta']:6.0f} host side; " if len(timed) == 2 else
                     " " * 39)
            name = f"canvas {canvas:>4}" if canvas else "decoded image"
            print(f"{recipe:<22}{name:<14}{speed}{100 * upsampled_share(recipes[recipe], canvas or None):5.1f}% "
                  "upsampled")
    profiled = next(iter(recipes))
    profile = profile_views(beton, recipes[profiled], args.canvas, args.batch_size, args.workers)
    print(f"\nwhere a {profiled} batch of {args.batch_size} goes on the CPU (ms per batch, decode once, "
          f"{f'canvas {args.canvas}' if args.canvas else 'from the decoded image'}):")
    for name, ms in profile:
        print(f"  {name:<60}{ms:9.1f}")
    return {"command": "loader", "recipe_set": "imagenet", "images": described, "batch_size": args.batch_size,
            "workers": args.workers, "canvas": args.canvas, "rows": rows, "host_ms_per_image": host,
            "profile_ms_per_batch": profile, "load_average_1min": os.getloadavg()[0], "torch": torch.__version__}
