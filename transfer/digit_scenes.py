"""Write the digit scenes: a detection data set generated from the embedded UCI digits, in COCO format.

Each scene is a square RGB image (`image_size` px, 96 by default) with a cluttered background (a colour
gradient, random rectangles, ellipses, circles and line segments in random dark colours, pixel noise) and
2 to 5 UCI digits pasted on it at random positions, sizes (glyph cell 15-42% of the side: 14-40 px at
96 px) and colours, each colour at least MIN_CONTRAST (RGB distance) from the background under it. The
digits' ink boxes never overlap (at least BOX_GAP px apart), so every box holds one whole, unoccluded digit.

The clutter is dark (channels up to BACKGROUND_MAX) and the digits bright: the UCI digits are light strokes
on black, and this keeps the polarity an encoder pretrained on them has seen, so that what the scenes
measure is transfer to new positions, scales, colours and clutter. (On light clutter the pretrained digits
encoder of configs/pretrain/simclr_digits.yaml told the scenes' digits apart no better than chance.)

Train scenes paste only the digits of the digits *train* split and val scenes only those of the *val* split
(`pretrain.data.digits.digits_split`, the split pretraining and evaluation use), so no digit image is seen
on both sides. Scene i of a split is drawn from its own generator, seeded with (seed, split, i): the same
seed gives the same set, and a longer set starts with the scenes of a shorter one.

    OUT/train/000000.jpg ...   OUT/train.json      (JPEG quality 95, 4:4:4)
    OUT/val/000000.jpg ...     OUT/val.json

The JSON files are COCO instances files: `images` (id from 1, file_name relative to OUT/SPLIT, width,
height), `annotations` (id from 1, image_id, category_id 1..10 for digits 0..9, bbox [x, y, w, h] in pixels,
the tight box of the digit's ink: the pixels x..x+w-1, y..y+h-1; area = w * h; iscrowd 0; and digit_index,
the pasted digit's index into sklearn's load_digits), `categories` (ids 1..10, names "0".."9") and `info`
(the generator's parameters, which say whether a set on disk is the one asked for). Detectron2 reads them
with `register_coco_instances(name, {}, paths["train_json"], paths["train_images"])`.

A digit's ink is its glyph's intensity ramped to an opacity: 0 below INK_RAMP[0], 1 above INK_RAMP[1]. The
box is tight around the pixels of non-zero opacity, and no pixel outside the box is touched by the paste.

Everything is written under a temporary folder and renamed into place, the JSON files last: a set whose two
JSON files exist is complete. `write_digit_scenes` skips a complete set with the same parameters (unless
`force`) and refuses to overwrite one with other parameters without `force`.

    python -m transfer digit-scenes --out-dir data/digit_scenes [--num-train N --num-val N --image-size PX
                                                                  --seed S --force]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np

from pretrain.data.digits import digits_images, digits_split
from pretrain.runtime.argument_types import non_negative_int, output_folder, positive_int

FORMAT_VERSION = 1
SPLITS = ("train", "val")
SPLIT_SEED_CODE = {"train": 0, "val": 1}     # scene i of a split is drawn from default_rng([seed, code, i])
DIGITS_PER_SCENE = (2, 5)                    # asked for, inclusive; fewer when no free place is found
DIGIT_SIDE_FRACTION = (0.15, 0.42)           # glyph cell side over the image side (14-40 px at 96 px)
CLUTTER_SHAPES = (5, 12)                     # background shapes per scene, inclusive
BACKGROUND_MAX = 96.0                        # background and clutter colours lie in [0, BACKGROUND_MAX] per channel
INK_RAMP = (0.25, 0.75)                      # glyph intensity -> opacity: 0 below, 1 above, linear between
MIN_CONTRAST = 200.0                         # RGB distance between a digit's colour and the background under it
BOX_GAP = 2                                  # pixels kept free between two digits' ink boxes
PLACEMENT_TRIES = 30
NOISE_STD = 6.0                              # Gaussian pixel noise of the background, in 0..255 units
JPEG_QUALITY = 95                            # with 4:4:4 chroma (no subsampling)
GLYPH_SIDE = 32                              # the digits are read at 32 px (as pretraining sees them), then resized

DEFAULT_NUM_TRAIN = 2000
DEFAULT_NUM_VAL = 500
DEFAULT_IMAGE_SIZE = 96


class DigitScenesError(ValueError):
    """A digit-scenes folder that cannot be used as asked; the message says why and what to do."""


@dataclass
class PastedDigit:
    """One digit of a scene: its class, where it came from, its tight ink box and how it was drawn."""

    digit: int                               # 0..9 (COCO category_id = digit + 1)
    digit_index: int                         # index into sklearn's load_digits
    box: tuple[int, int, int, int]           # x, y, w, h of the ink, in pixels
    cell: tuple[int, int, int]               # x, y, side of the pasted glyph cell
    colour: tuple[float, float, float]
    opacity: np.ndarray                      # (side, side) float32: how much of `colour` each cell pixel got


@dataclass
class Scene:
    image: np.ndarray                        # (S, S, 3) uint8 RGB, the scene
    background: np.ndarray                   # (S, S, 3) uint8 RGB, the same scene before the digits were pasted
    digits: list[PastedDigit] = field(default_factory=list)


@dataclass
class DigitGlyphs:
    """The digits pasted into one split: opacity glyphs at GLYPH_SIDE px, their labels and load_digits indices."""

    opacity: np.ndarray                      # (N, GLYPH_SIDE, GLYPH_SIDE) float32 in [0, 1]
    labels: np.ndarray                       # (N,) 0..9
    indices: np.ndarray                      # (N,) index into load_digits


@functools.lru_cache(maxsize=2)
def split_glyphs(split: str) -> DigitGlyphs:
    """The digits of `split` ("train" or "val") of the digits split that pretraining uses (cached, read-only)."""
    images, labels = digits_images(GLYPH_SIDE)
    train, val = digits_split(labels)
    indices = {"train": train, "val": val}[split]
    intensity = images[indices, :, :, 0].astype(np.float32) / 255.0
    low, high = INK_RAMP
    opacity = np.clip((intensity - low) / (high - low), 0.0, 1.0)
    opacity.flags.writeable = False
    return DigitGlyphs(opacity=opacity, labels=labels[indices], indices=np.asarray(indices))


# ============ drawing one scene ============


def cluttered_background(rng: np.random.Generator, size: int) -> np.ndarray:
    """A (size, size, 3) float32 background: a two-colour gradient, random shapes, pixel noise (all dark)."""
    start, end = rng.uniform(0, BACKGROUND_MAX, 3), rng.uniform(0, BACKGROUND_MAX, 3)
    angle = rng.uniform(0, 2 * np.pi)
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float32) / max(size - 1, 1)
    t = (np.cos(angle) * xs + np.sin(angle) * ys)
    t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
    image = (start[None, None] * (1 - t[..., None]) + end[None, None] * t[..., None]).astype(np.float32)
    for _ in range(int(rng.integers(CLUTTER_SHAPES[0], CLUTTER_SHAPES[1] + 1))):
        colour = tuple(float(c) for c in rng.uniform(0, BACKGROUND_MAX, 3))
        kind = rng.integers(4)
        x0, y0, x1, y1 = (int(v) for v in rng.integers(-size // 4, size + size // 4, 4))
        thickness = int(rng.integers(1, 4))
        if kind == 0:
            cv2.rectangle(image, (x0, y0), (x1, y1), colour, -1 if rng.random() < 0.5 else thickness)
        elif kind == 1:
            axes = (int(rng.integers(2, size // 3)), int(rng.integers(2, size // 3)))
            cv2.ellipse(image, (x0, y0), axes, float(rng.uniform(0, 180)), 0, 360, colour,
                        -1 if rng.random() < 0.5 else thickness)
        elif kind == 2:
            cv2.line(image, (x0, y0), (x1, y1), colour, thickness)
        else:
            cv2.circle(image, (x0, y0), int(rng.integers(2, size // 4)), colour, thickness)
    image += rng.normal(0.0, NOISE_STD, image.shape).astype(np.float32)
    return np.clip(image, 0, 255)


def ink_box(opacity: np.ndarray) -> tuple[int, int, int, int] | None:
    """x, y, w, h of the non-zero pixels of a glyph (None when it has none)."""
    rows, cols = np.nonzero(opacity.any(axis=1))[0], np.nonzero(opacity.any(axis=0))[0]
    if len(rows) == 0:
        return None
    return int(cols[0]), int(rows[0]), int(cols[-1] - cols[0] + 1), int(rows[-1] - rows[0] + 1)


def boxes_apart(a: tuple[int, int, int, int], b: tuple[int, int, int, int], gap: int) -> bool:
    """True when boxes (x, y, w, h) are at least `gap` px apart along x or along y."""
    return (a[0] + a[2] + gap <= b[0] or b[0] + b[2] + gap <= a[0]
            or a[1] + a[3] + gap <= b[1] or b[1] + b[3] + gap <= a[1])


def resized_glyph(opacity: np.ndarray, side: int) -> np.ndarray:
    """A GLYPH_SIDE opacity glyph resized to `side` px (values in [0, 1], resampling specks zeroed)."""
    interpolation = cv2.INTER_AREA if side < GLYPH_SIDE else cv2.INTER_LINEAR
    resized = np.clip(cv2.resize(opacity, (side, side), interpolation=interpolation), 0.0, 1.0)
    resized[resized < 1e-3] = 0.0          # resampling leaves specks of 1e-8 that would widen the box
    return resized


def paste_glyph(rng: np.random.Generator, image: np.ndarray, background: np.ndarray, opacity: np.ndarray,
                x: int, y: int, box: tuple[int, int, int, int]) -> np.ndarray:
    """Paint the glyph cell `opacity` at (x, y) of `image` in a random colour at least MIN_CONTRAST from the
    `background` under its ink box `box` (the most distant of PLACEMENT_TRIES draws if none is); returns it."""
    under = background[box[1]:box[1] + box[3], box[0]:box[0] + box[2]].reshape(-1, 3).mean(axis=0)
    candidates = rng.uniform(0, 255, (PLACEMENT_TRIES, 3))
    distances = np.linalg.norm(candidates - under, axis=1)
    far_enough = np.nonzero(distances >= MIN_CONTRAST)[0]
    colour = candidates[far_enough[0] if len(far_enough) else int(np.argmax(distances))]
    side = opacity.shape[0]
    alpha = opacity[..., None]
    cell = image[y:y + side, x:x + side]
    image[y:y + side, x:x + side] = cell * (1 - alpha) + colour[None, None] * alpha
    return colour


def render_scene(rng: np.random.Generator, glyphs: DigitGlyphs, size: int) -> Scene:
    """Draw one scene of `size` px from `glyphs`; every random choice comes from `rng`."""
    background = cluttered_background(rng, size)
    image = background.copy()
    low, high = (max(4, round(f * size)) for f in DIGIT_SIDE_FRACTION)
    digits: list[PastedDigit] = []
    for _ in range(int(rng.integers(DIGITS_PER_SCENE[0], DIGITS_PER_SCENE[1] + 1))):
        choice = int(rng.integers(len(glyphs.labels)))
        side = int(rng.integers(low, min(high, size) + 1))
        opacity = resized_glyph(glyphs.opacity[choice], side)
        glyph_box = ink_box(opacity)
        if glyph_box is None:
            continue
        for _ in range(PLACEMENT_TRIES):
            x, y = (int(v) for v in rng.integers(0, size - side + 1, 2))
            box = (x + glyph_box[0], y + glyph_box[1], glyph_box[2], glyph_box[3])
            if all(boxes_apart(box, other.box, BOX_GAP) for other in digits):
                break
        else:
            continue
        colour = paste_glyph(rng, image, background, opacity, x, y, box)
        digits.append(PastedDigit(digit=int(glyphs.labels[choice]), digit_index=int(glyphs.indices[choice]),
                                  box=box, cell=(x, y, side), colour=tuple(float(c) for c in colour),
                                  opacity=opacity))
    return Scene(image=np.clip(np.rint(image), 0, 255).astype(np.uint8),
                 background=np.clip(np.rint(background), 0, 255).astype(np.uint8), digits=digits)


def scene_generator(seed: int, split: str, index: int) -> np.random.Generator:
    """The generator scene `index` of `split` is drawn from (also what tests re-render a written scene with)."""
    return np.random.default_rng([seed, SPLIT_SEED_CODE[split], index])


# ============ the data set on disk ============


def split_info(split: str, num_images: int, image_size: int, seed: int) -> dict:
    """The `info` block of a split's JSON: what a set on disk is compared with before it is reused."""
    return {"description": f"digit scenes ({split}): UCI digits of the {split} split of pretrain.data.digits "
                           "pasted on cluttered backgrounds, written by transfer.digit_scenes",
            "format_version": FORMAT_VERSION, "split": split, "num_images": num_images, "image_size": image_size,
            "seed": seed}


def categories() -> list[dict]:
    return [{"id": digit + 1, "name": str(digit), "supercategory": "digit"} for digit in range(10)]


def write_split(folder: Path, split: str, num_images: int, image_size: int, seed: int) -> dict:
    """Write the scenes of `split` as JPEG files into `folder` and return its COCO dictionary."""
    glyphs = split_glyphs(split)
    folder.mkdir(parents=True)
    images, annotations = [], []
    for index in range(num_images):
        scene = render_scene(scene_generator(seed, split, index), glyphs, image_size)
        file_name = f"{index:06d}.jpg"
        # 4:4:4: no chroma subsampling, which would smear the thin coloured strokes of small digits
        ok, encoded = cv2.imencode(".jpg", cv2.cvtColor(scene.image, cv2.COLOR_RGB2BGR),
                                   [cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY,
                                    cv2.IMWRITE_JPEG_SAMPLING_FACTOR, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444])
        if not ok:
            raise RuntimeError(f"OpenCV could not encode scene {index} of {split} as JPEG")
        (folder / file_name).write_bytes(encoded.tobytes())
        image_id = index + 1                   # COCO ids start at 1 (COCOeval treats a matched id 0 as unmatched)
        images.append({"id": image_id, "file_name": file_name, "width": image_size, "height": image_size})
        for digit in scene.digits:
            x, y, w, h = digit.box
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, "category_id": digit.digit + 1,
                                "bbox": [x, y, w, h], "area": w * h, "iscrowd": 0,
                                "digit_index": digit.digit_index})
    return {"info": split_info(split, num_images, image_size, seed), "images": images,
            "annotations": annotations, "categories": categories()}


def scene_paths(out_dir: str | Path) -> dict[str, Path]:
    """Where a digit-scenes set lives: root, train_json, val_json, train_images, val_images."""
    root = Path(out_dir)
    return {"root": root, "train_json": root / "train.json", "val_json": root / "val.json",
            "train_images": root / "train", "val_images": root / "val"}


def read_split_info(json_path: Path) -> dict | None:
    """The `info` of a written split, or None when the file is absent or not a digit-scenes JSON."""
    try:
        info = json.loads(json_path.read_text()).get("info")
    except (OSError, ValueError, AttributeError):
        return None
    return info if isinstance(info, dict) else None


def write_digit_scenes(out_dir: str | Path, *, num_train: int = DEFAULT_NUM_TRAIN, num_val: int = DEFAULT_NUM_VAL,
                       image_size: int = DEFAULT_IMAGE_SIZE, seed: int = 0, force: bool = False) -> dict:
    """Write the digit scenes to OUT_DIR (see the module docstring) and return their paths.

    Returns {"root", "train_json", "val_json", "train_images", "val_images"} (Paths) and "written" (False when
    a complete set with these parameters was there already and was kept).
    Raises DigitScenesError for bad sizes, or when OUT_DIR holds a complete set with other parameters and
    `force` is not set.
    """
    if num_train < 1 or num_val < 1:
        raise DigitScenesError(f"num_train={num_train}, num_val={num_val}: each split needs at least 1 scene")
    low_side = round(DIGIT_SIDE_FRACTION[0] * image_size)
    if image_size < 32:
        raise DigitScenesError(f"image_size={image_size} px leaves digits of {low_side} px; use at least 32 "
                               f"(default {DEFAULT_IMAGE_SIZE})")
    paths = scene_paths(out_dir)
    root = paths["root"]
    wanted = {split: split_info(split, count, image_size, seed) for split, count in (("train", num_train),
                                                                                    ("val", num_val))}
    found = {split: read_split_info(paths[f"{split}_json"]) for split in SPLITS}
    complete = all(info is not None for info in found.values())
    if complete and not force:
        if found == wanted:
            return {**paths, "written": False}
        differences = ", ".join(f"{split}.{key}={found[split].get(key)!r} (asked {value!r})"
                                for split in SPLITS for key, value in wanted[split].items()
                                if key != "description" and found[split].get(key) != value)
        raise DigitScenesError(f"{root} holds digit scenes with other parameters: {differences}; rewrite them with "
                               f"force (`python -m transfer digit-scenes --out-dir {root} --force ...`) or use "
                               "another folder")
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".writing.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        for split, count in (("train", num_train), ("val", num_val)):
            coco = write_split(staging / split, split, count, image_size, seed)
            (staging / f"{split}.json").write_text(json.dumps(coco))
        # The JSON files mark a set complete: remove them first, move the image folders, then the JSON files.
        for split in SPLITS:
            paths[f"{split}_json"].unlink(missing_ok=True)
        for split in SPLITS:
            target = paths[f"{split}_images"]
            if target.exists():
                retired = root / f".retired.{split}.{os.getpid()}"
                os.replace(target, retired)
                shutil.rmtree(retired)
            os.replace(staging / split, target)
        for split in SPLITS:
            os.replace(staging / f"{split}.json", paths[f"{split}_json"])
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {**paths, "written": True}


# ============ moved digits: one digit per image, a classification set ============

MOVED_DIGIT_SIDE = (0.45, 0.9)               # glyph cell side over the image side (14-29 px at 32 px)
MOVED_SEED_CODE = {"train": 10, "val": 11}   # image i of a split is drawn from default_rng([seed, code, i])


def render_moved_digit(rng: np.random.Generator, opacity: np.ndarray, size: int) -> np.ndarray:
    """One glyph on a cluttered `size` px background at a random scale, position and colour (uint8 RGB)."""
    background = cluttered_background(rng, size)
    image = background.copy()
    side = int(rng.integers(round(MOVED_DIGIT_SIDE[0] * size), round(MOVED_DIGIT_SIDE[1] * size) + 1))
    cell = resized_glyph(opacity, side)
    x, y = (int(v) for v in rng.integers(0, size - side + 1, 2))
    glyph_box = ink_box(cell) or (0, 0, side, side)
    paste_glyph(rng, image, background, cell, x, y, (x + glyph_box[0], y + glyph_box[1], glyph_box[2], glyph_box[3]))
    return np.clip(np.rint(image), 0, 255).astype(np.uint8)


def write_moved_digits(out_dir: str | Path, *, image_size: int = 32, seed: int = 0, force: bool = False,
                       workers: int = 2) -> dict[str, Path]:
    """Every digit of the digits train and val splits once, moved, scaled (cell 45-90% of the side) and
    recoloured on the scenes' dark clutter: OUT_DIR/train.beton and OUT_DIR/val.beton (+ .classes.json),
    labels 0-9, for k-NN and linear evaluation where raw pixels cannot simply match aligned strokes.
    Existing files are kept unless `force`. Returns {"train": path, "val": path}."""
    from pretrain.data.writer import ArrayImageSet, classes_path, replace_atomically, write_beton

    out_dir = Path(out_dir)
    targets = {split: out_dir / f"{split}.beton" for split in SPLITS}
    if not force and all(path.exists() for path in targets.values()):
        return targets
    out_dir.mkdir(parents=True, exist_ok=True)
    names = json.dumps([str(digit) for digit in range(10)])
    for split, path in targets.items():
        glyphs = split_glyphs(split)
        images = np.stack([render_moved_digit(np.random.default_rng([seed, MOVED_SEED_CODE[split], i]),
                                              glyphs.opacity[i], image_size) for i in range(len(glyphs.labels))])
        write_beton(path, ArrayImageSet(images.__getitem__, glyphs.labels.tolist(), None), workers=workers)
        replace_atomically(lambda tmp: tmp.write_text(names), classes_path(path))
    return targets


# ============ command line: python -m transfer digit-scenes ============


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out-dir", default="data/digit_scenes", type=output_folder,
                        help="folder for train/, val/, train.json and val.json (default: %(default)s)")
    parser.add_argument("--num-train", type=positive_int, default=DEFAULT_NUM_TRAIN, metavar="N",
                        help="training scenes (default: %(default)s)")
    parser.add_argument("--num-val", type=positive_int, default=DEFAULT_NUM_VAL, metavar="N",
                        help="validation scenes (default: %(default)s)")
    parser.add_argument("--image-size", type=positive_int, default=DEFAULT_IMAGE_SIZE, metavar="PX",
                        help="side of the square scenes, at least 32; digits are 15-42%% of it "
                             "(default: %(default)s)")
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="seed of every random choice (default: %(default)s)")
    parser.add_argument("--force", action="store_true",
                        help="rewrite the set even when OUT_DIR holds a complete one (with the same or other "
                             "parameters)")
    parser.add_argument("--moved-digits", action="store_true",
                        help="write the moved-digits classification set instead: every digit once, moved, scaled "
                             "and recoloured on clutter, as OUT_DIR/train.beton and val.beton (--image-size "
                             "default 32 here; --num-train / --num-val do not apply)")


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    if args.moved_digits:
        size = 32 if args.image_size == DEFAULT_IMAGE_SIZE else args.image_size
        targets = write_moved_digits(args.out_dir, image_size=size, seed=args.seed, force=args.force)
        print(f"moved digits, {size} px: {targets['train']}  {targets['val']} ({time.perf_counter() - started:.1f} s)")
        return 0
    try:
        paths = write_digit_scenes(args.out_dir, num_train=args.num_train, num_val=args.num_val,
                                   image_size=args.image_size, seed=args.seed, force=args.force)
    except DigitScenesError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    counts = {split: len(json.loads(paths[f"{split}_json"].read_text())["annotations"]) for split in SPLITS}
    verb = "wrote" if paths["written"] else "kept the complete set in"
    print(f"{verb} {paths['root']}: {args.num_train} train scenes ({counts['train']} digits), {args.num_val} val "
          f"scenes ({counts['val']} digits), {args.image_size} px, seed {args.seed} "
          f"({time.perf_counter() - started:.1f} s)")
    print(f"  {paths['train_json']}  {paths['val_json']}")
    return 0
