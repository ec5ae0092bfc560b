"""`python -m pretrain.bench storage`: what the stored form of an ImageNet-sized image folder (the longer side
`pretrain.data write --max-side` allows, JPEG quality or raw pixels) costs the loader and takes from the views.

For each stored form of the same JPEGs cut from real photographs (`bench loader --sizes imagenet`'s images):
- its bytes per image (the images' allocations in the .beton, without the file's page padding);
- the host's CPU milliseconds per image of a GPU run (decode once, views cut from the decoded image, as the
  ImageNet presets run; `bench loader`'s device "meta": the device's work left out), in alternating rounds, each
  case in a process of its own, quoted as median and range over the rounds;
- how far its views are from the same views cut from the folder's JPEGs themselves: per view group of the recipe,
  the same crop boxes (fractions of the image, one generator per image) cut from the stored image and from the
  folder's image at its own size by the loader's own crop-and-resize, the PSNR between the two (median and 10th
  percentile over the views; raw pixels at the folder's size give identical views), and the share of views whose
  crop covers fewer stored pixels than the view has (upsampled: blurrier than the source allows).
This measures the loader and the pixels, not accuracy: which PSNR costs a linear probe what is not measured here
(that needs pretraining on labelled photographs: docs/benchmarks.md says what was chosen and why).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import torch

from pretrain.bench.images import PHOTO_SIZES, PHOTO_SOURCE, benchmark_folder
from pretrain.bench.loader import GPU_FEED_RATE, imagenet_recipes, run_case_in_own_process
from pretrain.bench.machine import machine_heading, this_machine
from pretrain.bench.precision import median_and_range
from pretrain.runtime.argument_types import positive_int

DEFAULT_STORES = ["320:90", "512:90", "512:95", "512:raw", "0:90"]


def parse_store(text: str) -> dict:
    """'MAX_SIDE:QUALITY' or 'MAX_SIDE:raw' (MAX_SIDE 0: every image at its own size) -> the writer's arguments."""
    side, _, quality = text.partition(":")
    if not side.isdigit() or not (quality == "raw" or (quality.isdigit() and 1 <= int(quality) <= 100)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a stored form: write MAX_SIDE:QUALITY (e.g. 320:90; "
                                         "quality 1-100) or MAX_SIDE:raw, MAX_SIDE 0 keeping every image's size")
    return {"name": text, "max_side": int(side) or None,
            "write_mode": "raw" if quality == "raw" else "jpg", "jpeg_quality": 90 if quality == "raw" else int(quality)}


def stored_betons(folder: Path, stores: list[dict], work_dir: Path, workers: int) -> dict[str, Path]:
    """One .beton per stored form, written by `pretrain.data write`'s writer (reused when complete)."""
    # heavy: cv2, FFCV, for this benchmark only (see pretrain/bench/__init__.py)
    from pretrain.data.writer import write_image_folder

    betons = {}
    for store in stores:
        beton = work_dir / f"{folder.name}-{store['name'].replace(':', '-')}.beton"
        if not beton.exists():
            write_image_folder(folder, beton, workers=workers, max_side=store["max_side"],
                               write_mode=store["write_mode"], jpeg_quality=store["jpeg_quality"])
        betons[store["name"]] = beton
    return betons


def stored_bytes_per_image(beton: Path) -> float:
    """The images' own bytes (FFCV's allocation table), not the file's: the file is padded to whole pages."""
    # heavy: FFCV, for this benchmark only (see pretrain/bench/__init__.py)
    from ffcv.reader import Reader

    reader = Reader(str(beton))
    return float(reader.alloc_table["size"].sum()) / reader.num_samples


def view_fidelity(folder: Path, beton: Path, groups: list, views_per_group: int, seed: int = 0) -> dict:
    """Per distinct view group (size, scale) of the recipe: the PSNR (dB) of the views cut from the stored images
    against the same boxes cut from the folder's images (median, 10th percentile; inf where identical), and the
    share of the stored views that are upsampled. Boxes come from one generator per image, drawn on the folder
    image's height and width as fractions, so every stored form is compared on the same crops."""
    # heavy: cv2, FFCV, for this benchmark only (see pretrain/bench/__init__.py)
    from pretrain.data.augment import crop_resize_flip_one_by_one, sample_crop_boxes
    from pretrain.data.ffcv_loader import build_ffcv_loader, ffcv_batches
    from pretrain.data.writer import list_image_folder, read_rgb

    paths = list_image_folder(folder)[0]
    loader = build_ffcv_loader(beton, 0, 1, 1, drop_last=False)
    if loader.reader.num_samples != len(paths):
        raise SystemExit(f"error: {beton} holds {loader.reader.num_samples} images, {folder} {len(paths)}: delete the "
                         ".beton (it is written again)")
    distinct = {(g.size, tuple(g.scale), tuple(g.ratio), g.interpolation): g for g in groups}
    psnr = {key: [] for key in distinct}
    upsampled = {key: 0 for key in distinct}
    for canvas, _label, index, height, width in ffcv_batches(loader, np.arange(len(paths))):
        original = torch.from_numpy(read_rgb(paths[int(index)]))[None]
        generator = torch.Generator().manual_seed(seed * 1_000_003 + int(index))
        stored_hw = torch.stack([height, width], 1)
        for key, group in distinct.items():
            boxes = sample_crop_boxes(torch.tensor([original.shape[1:3]]).expand(views_per_group, 2), group.scale,
                                      group.ratio, generator)
            flip = torch.zeros(views_per_group, dtype=torch.bool)
            cut = [crop_resize_flip_one_by_one(image, boxes, views_per_group, group.size, flip, extent=extent,
                                               interpolation=group.interpolation)
                   for image, extent in ((original, None), (canvas, stored_hw))]
            mse = (cut[0] - cut[1]).pow(2).flatten(1).mean(1)
            psnr[key] += (10 * torch.log10(255.0 ** 2 / mse)).tolist()       # mse 0 -> inf: identical
            crop_h = (boxes[:, 3] - boxes[:, 1]) * float(height)
            crop_w = (boxes[:, 2] - boxes[:, 0]) * float(width)
            upsampled[key] += int(((crop_h < group.size) | (crop_w < group.size)).sum())

    def decibels(values: list[float], percent: int) -> float | None:     # None: every such view identical (inf)
        value = float(np.percentile(values, percent, method="lower"))      # "lower": no inf - inf interpolated
        return None if value == float("inf") else value

    return {f"{key[0]} px, scale {key[1][0]}-{key[1][1]}": {             # key: (size, scale, ratio, interpolation)
                "psnr_db_median": decibels(psnr[key], 50), "psnr_db_p10": decibels(psnr[key], 10),
                "upsampled_share": upsampled[key] / len(psnr[key]), "views": len(psnr[key])}
            for key in distinct}


def decibels_text(value: float | None) -> str:
    return "identical" if value is None else f"{value:.1f} dB"


def run_storage_benchmark(args: argparse.Namespace) -> dict:
    work_dir = Path(args.data_dir)
    folder, described = benchmark_folder(work_dir, args.images, args.photos, args.photo_size)
    betons = stored_betons(folder, args.stores, work_dir, args.workers)
    groups = imagenet_recipes()[args.recipe]
    torch.set_num_threads(args.workers)            # as each timed case sets them (`run_loader_case`)
    machine = this_machine()
    print(f"{described}\n{machine_heading(machine)}\n1-minute load average before: {os.getloadavg()[0]:.2f}",
          flush=True)
    host_ms = {name: [] for name in betons}
    for round_ in range(args.rounds):          # the order reversed from one round to the next (drift falls alike)
        order = list(betons) if round_ % 2 == 0 else list(reversed(betons))
        for name in order:
            row = run_case_in_own_process({"recipe": args.recipe, "loader": "decode once", "canvas": 0,
                                           "device": "meta", "beton": str(betons[name]), "folder": str(folder)},
                                          args.batch_size, args.workers, args.epochs)
            host_ms[name].append(1000 / row["images_per_cpu_s"])
        print(f"  round {round_ + 1}/{args.rounds}: " + ", ".join(f"{n} {host_ms[n][-1]:.2f} ms" for n in order),
              flush=True)
    rows = []
    for store in args.stores:
        name = store["name"]
        rows.append({"store": name, "bytes_per_image": stored_bytes_per_image(betons[name]),
                     "host_ms_per_image": median_and_range(host_ms[name]), "rounds_ms": host_ms[name],
                     "views": view_fidelity(folder, betons[name], groups, args.views_per_group)})
    groups_seen = list(rows[0]["views"])
    lines = [f"| stored (max side : quality) | KB per image | host ms per image, median (range) | cores per GPU at "
             f"{GPU_FEED_RATE:,} images/s | " + " | ".join(f"{g}: PSNR median (p10), upsampled" for g in groups_seen)
             + " |", "| --- " * (4 + len(groups_seen)) + "|"]
    for row in rows:
        ms = row["host_ms_per_image"]
        cells = [f"{decibels_text(v['psnr_db_median'])} ({decibels_text(v['psnr_db_p10'])}), "
                 f"{100 * v['upsampled_share']:.0f}%" for v in row["views"].values()]
        lines.append(f"| {row['store']} | {row['bytes_per_image'] / 1024:.0f} | {ms['median']:.2f} ({ms['min']:.2f}-"
                     f"{ms['max']:.2f}) | {GPU_FEED_RATE * ms['median'] / 1000:.1f} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(f"\n{args.recipe}, batch {args.batch_size}, {args.workers} workers, {args.rounds} rounds; views against the "
          f"same crops of the folder's JPEGs ({args.views_per_group} per group and image)\n{table}")
    return {"command": "storage", "images": described, "recipe": args.recipe, "batch_size": args.batch_size,
            "workers": args.workers, "rounds": args.rounds, "machine": machine, "rows": rows, "table": table,
            "load_average_1min": os.getloadavg()[0], "torch": torch.__version__}


def add_storage_command(commands) -> None:
    storage = commands.add_parser(
        "storage", help="stored forms of ImageNet-sized photographs (max side, JPEG quality): bytes, host time, "
                        "view fidelity",
        description="For each stored form (pretrain.data write --max-side, --jpeg-quality or raw) of the same JPEGs "
                    "cut from real photographs: bytes per image, the GPU run's host CPU time per image (decode once), "
                    "and the PSNR of its views against the same crops of the folder's JPEGs.")
    storage.add_argument("--stores", nargs="+", type=parse_store, default=[parse_store(s) for s in DEFAULT_STORES],
                         metavar="MAX_SIDE:QUALITY",
                         help="stored forms: MAX_SIDE:QUALITY or MAX_SIDE:raw, MAX_SIDE 0 keeping every image's size. "
                              f"Default: {' '.join(DEFAULT_STORES)}.")
    storage.add_argument("--recipe", choices=tuple(imagenet_recipes()), default="DINO 2x224+6x96",
                         help="the views timed and compared. Default: DINO 2x224+6x96 (the smallest crops).")
    storage.add_argument("--images", type=positive_int, default=256, help="JPEGs cut from the photographs. Default: 256.")
    storage.add_argument("--photos", default=str(PHOTO_SOURCE),
                         help=f"a folder of photographs, or 'generated'. Default: {PHOTO_SOURCE} "
                              "(`apt-get install mate-backgrounds`).")
    storage.add_argument("--photo-size", choices=tuple(PHOTO_SIZES), default="400x350",
                         help="the JPEGs' size, ImageNet's typical or its largest. Default: 400x350.")
    storage.add_argument("--batch-size", type=positive_int, default=64, help="images per batch. Default: 64.")
    storage.add_argument("--workers", type=positive_int, default=2, help="FFCV threads, torch threads. Default: 2.")
    storage.add_argument("--epochs", type=positive_int, default=2, help="epochs timed per case (x4 on the host "
                                                                        "side, as `bench loader`). Default: 2.")
    storage.add_argument("--rounds", type=positive_int, default=3, help="alternating rounds of timing. Default: 3.")
    storage.add_argument("--views-per-group", type=positive_int, default=8,
                         help="views compared per image and view group. Default: 8.")
    storage.add_argument("--data-dir", default="bench/data", help="where the images and .beton files are cached. "
                                                                  "Default: bench/data.")
    storage.add_argument("--out", default="bench/storage.json", help="JSON result. Default: bench/storage.json.")
    storage.set_defaults(run=run_storage_benchmark)
