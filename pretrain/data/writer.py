"""Write image datasets to FFCV `.beton` files.

Every `.beton` written here has the fields, in this order:
    image  RGBImageField (JPEG by default, or raw uint8), at most `max_side` px on the longer side
    label  IntField, class index (-1 where unknown)
    index  IntField, the sample's row in this .beton (0 .. N-1)
    height IntField, stored image height in pixels (aspect ratios of crops are measured in these)
    width  IntField, stored image width in pixels
Next to `OUT.beton` the writer saves `OUT.classes.json` (class names in label order) and, when images could
not be read, `OUT.skipped.txt` (one `path<TAB>reason` per skipped image).

Sources: an image folder with one sub-folder per class (`write_image_folder`) or any indexed array source
(`write_beton`; the embedded digits set in `pretrain.data.digits` uses it).

Every file is written under a temporary name and renamed when complete: a failed or killed write leaves
the previous file (or none), never a `.beton` whose header claims samples it does not hold. Images are
stored at most DEFAULT_MAX_SIDE px on their longer side unless asked otherwise: loaders size their decode
buffers for the largest stored image times the batch, so one 6000 x 4000 photo would make every batch ask
for gigabytes.
"""
from __future__ import annotations

import fcntl
import json
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from pathlib import Path

import cv2
import numpy as np
from PIL import Image, ImageOps

from pretrain.data import DatasetError
from pretrain.data.writer_workers import children_die_with_their_parent, run_watching_workers_and_disk

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")   # what Pillow decodes
# (an animated GIF or WebP: its first frame)
FIELD_NAMES = ("image", "label", "index", "height", "width")
DEFAULT_MAX_SIDE = 512          # longer side of stored images: ImageNet's typical ~400 x 350 px stay as they are
# FFCV stores each sample within one page of the file (ffcv.writer: a power of two from 2 MiB to below 4 GiB);
# a sample larger than the page kills an FFCV writer worker, and the writer's parent then waits forever.
FFCV_DEFAULT_PAGE_SIZE = 8 << 20
FFCV_MAX_PAGE_SIZE = 1 << 32
# 16-bit grayscale modes of Pillow; convert("RGB") would clip them at 255 (nearly white images).
SIXTEEN_BIT_GRAY_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")


@dataclass
class WriteReport:
    """What a write produced: how many images went in and which were skipped (path, reason)."""

    out_path: Path
    written: int
    skipped: list[tuple[str, str]] = field(default_factory=list)
    class_names: list[str] = field(default_factory=list)

    def summary(self) -> str:
        what = f"in {len(self.class_names)} classes" if self.class_names else "without labels (label -1)"
        text = f"{self.out_path}: wrote {self.written} images {what}"
        if self.skipped:
            text += (f", skipped {len(self.skipped)} unreadable image(s), listed in "
                     f"{skipped_report_path(self.out_path)}")
        return text


def classes_path(beton_path: str | Path) -> Path:
    """`OUT.beton` -> `OUT.classes.json`, the class names in label order."""
    return Path(beton_path).with_suffix(".classes.json")


def is_unlabeled(beton_path: str | Path) -> bool:
    """Whether a .beton was written without labels (`write --unlabeled`: every label -1, OUT.classes.json `[]`)."""
    names = classes_path(beton_path)
    return names.is_file() and json.loads(names.read_text()) == []


def skipped_report_path(beton_path: str | Path) -> Path:
    """`OUT.beton` -> `OUT.skipped.txt`, one `path<TAB>reason` line per image left out."""
    return Path(beton_path).with_suffix(".skipped.txt")


def list_image_folder(root: str | Path) -> tuple[list[Path], list[int], list[str]]:
    """List an image folder laid out as root/<class name>/<image>.{jpg,jpeg,png}.

    Classes are the sub-folders in sorted name order (label = position); files are sorted by name inside
    each class. Both loader backends and the writer use this order, so dataset indices agree.
    Returns (paths, labels, class_names).
    """
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"Image folder {root} does not exist; pass a folder with one sub-folder per class.")
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is a file, not an image folder; pass a folder with one sub-folder per class.")
    class_dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not class_dirs:
        raise ValueError(f"Image folder {root} has no class sub-folders; put the images of each class in "
                         f"{root}/<class name>/ (e.g. {root}/cat/001.jpg), or pass --unlabeled to write its "
                         "images without labels (for self-supervised pretraining).")
    loose = [p.name for p in root.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS]
    if loose:
        raise ValueError(f"Image folder {root} has {len(loose)} image(s) beside its class sub-folders (e.g. "
                         f"{sorted(loose)[0]}), which would have no class: move them into a class folder, or pass "
                         "--unlabeled to write every image without labels.")
    paths, labels = [], []
    for label, class_dir in enumerate(class_dirs):
        for path in sorted(class_dir.rglob("*")):
            if path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS:
                paths.append(path)
                labels.append(label)
    if not paths:
        raise ValueError(f"Image folder {root} has class sub-folders but no images with extensions "
                         f"{', '.join(IMAGE_EXTENSIONS)}; check the path or the file extensions.")
    return paths, labels, [d.name for d in class_dirs]


def list_unlabeled_images(source: str | Path) -> list[Path]:
    """The images of an unlabeled source, sorted: every .jpg/.jpeg/.png under a folder at any depth (hidden files
    and folders left out), or the paths listed in a text file, one per line (relative paths are relative to the
    list's folder; blank lines and lines starting with # are ignored)."""
    source = Path(source)
    if not source.exists():
        raise FileNotFoundError(f"{source} does not exist; pass a folder of images (any depth) or a text file "
                                "listing image paths, one per line.")
    if source.is_file():
        lines = [line.strip() for line in source.read_text(errors="replace").splitlines()]
        paths = [source.parent / line for line in lines if line and not line.startswith("#")]
        if not paths:
            raise ValueError(f"The image list {source} names no image; write one image path per line.")
        return paths                                   # a listed file that is missing or unreadable is skipped
    paths = sorted(path for path in source.rglob("*") if path.is_file()
                   and path.suffix.lower() in IMAGE_EXTENSIONS
                   and not any(part.startswith(".") for part in path.relative_to(source).parts))
    if not paths:
        raise ValueError(f"Image folder {source} has no images with extensions {', '.join(IMAGE_EXTENSIONS)} at "
                         "any depth; check the path or the file extensions.")
    return paths


def limit_side(image: np.ndarray, max_side: int | None) -> np.ndarray:
    """Shrink an HWC uint8 image so that its longer side is at most `max_side` (aspect kept; never enlarges)."""
    if max_side is None:
        return image
    height, width = image.shape[:2]
    longer = max(height, width)
    if longer <= max_side:
        return image
    ratio = max_side / longer
    new_size = (max(1, round(width * ratio)), max(1, round(height * ratio)))
    return cv2.resize(image, new_size, interpolation=cv2.INTER_AREA)


def read_rgb(path: str | Path) -> np.ndarray:
    """Decode an image file to an HWC uint8 RGB array; raises OSError / ValueError on unreadable files.

    16-bit grayscale images (PNG) are scaled to 8 bits (value / 257); Pillow already reduces 16-bit RGB. 32-bit float
    images (TIFF) with values in [0, 1] are scaled by 255; other float ranges are refused (ValueError: the writer
    skips and lists the image), since no scale is right for all of them. A JPEG's EXIF orientation is applied (a
    camera's portrait photo is stored upright, not on its side)."""
    with Image.open(path) as opened:
        opened.load()              # decodes fully: truncated files fail here, not at write time
        image = ImageOps.exif_transpose(opened)
        if image.mode in SIXTEEN_BIT_GRAY_MODES:
            gray = np.asarray(image).astype(np.float64) / 257.0
            gray = np.clip(np.rint(gray), 0, 255).astype(np.uint8)
            return np.repeat(gray[..., None], 3, axis=2)
        if image.mode == "F":          # 32-bit float (TIFF): convert("RGB") would clip 0.5 and 0.9 to black
            values = np.asarray(image, dtype=np.float64)
            low, high = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
            if not np.isfinite(values).all() or low < 0 or high > 1:
                raise ValueError(f"a 32-bit float image with values from {low:g} to {high:g}: only floats in [0, 1] "
                                 "are scaled to 8 bits (x 255); save it as an 8- or 16-bit image")
            gray = np.rint(values * 255).astype(np.uint8)
            return np.repeat(gray[..., None], 3, axis=2)
        return np.asarray(image.convert("RGB"), dtype=np.uint8).copy()


def _check_readable(path: Path) -> tuple[str | None, tuple[int, int]]:
    """(None, (height, width)) when `path` decodes to a non-empty RGB image, else (the reason it cannot be
    used, (0, 0))."""
    try:
        image = read_rgb(path)
    except Exception as error:     # PIL raises many types (OSError, SyntaxError, ValueError, DecompressionBomb...)
        return f"{type(error).__name__}: {error}".replace("\n", " ").replace("\t", " "), (0, 0)
    if image.ndim != 3 or image.shape[0] == 0 or image.shape[1] == 0:
        return f"empty image of shape {image.shape}", (0, 0)
    return None, (int(image.shape[0]), int(image.shape[1]))


def stored_size(height: int, width: int, max_side: int | None) -> tuple[int, int]:
    """(height, width) of an image once `limit_side` has shrunk it to `max_side`."""
    if max_side is None or max(height, width) <= max_side:
        return height, width
    ratio = max_side / max(height, width)
    return max(1, round(height * ratio)), max(1, round(width * ratio))


def page_size_for(largest_pixels: int, largest_name: str = "the largest image") -> int:
    """An FFCV page size (a power of two) that holds the largest stored image, raw or as a JPEG (which, for
    noise at high quality, can come out a little larger than raw: twice raw is allowed for)."""
    needed = 2 * 3 * largest_pixels + (1 << 16)
    page = FFCV_DEFAULT_PAGE_SIZE
    while page < needed:
        page *= 2
    if page >= FFCV_MAX_PAGE_SIZE:
        raise DatasetError(f"{largest_name} has {largest_pixels} pixels, too many for one FFCV sample (under 4 GiB "
                           f"per sample): write with --max-side {DEFAULT_MAX_SIDE} (the default) or another bound")
    return page


def replace_atomically(write, path: Path) -> None:
    """Call `write(tmp)` to produce `path` under a temporary name in the same folder, then rename it onto
    `path`; on any failure the temporary file is removed and `path` is untouched."""
    tmp = path.with_name(f".{path.name}.partial")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class ArrayImageSet:
    """Indexed dataset for ffcv's DatasetWriter: sample i -> (image, label, index, height, width)."""

    def __init__(self, load_image, labels: list[int], max_side: int | None):
        self.load_image = load_image
        self.labels = labels
        self.max_side = max_side

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        image = limit_side(np.ascontiguousarray(self.load_image(index)), self.max_side)
        return image, int(self.labels[index]), int(index), int(image.shape[0]), int(image.shape[1])


def write_beton(out_path: str | Path, dataset: ArrayImageSet, *, write_mode: str = "jpg",
                jpeg_quality: int = 90, workers: int = 2, largest_pixels: int = 0) -> None:
    """Write `dataset` to `out_path` with the fields listed in the module docstring, atomically.

    largest_pixels: height x width of the largest stored image, to size FFCV's pages (0: the default page,
    enough for any image up to DEFAULT_MAX_SIDE).
    """
    # heavy: numba and FFCV (seconds), which the readers of this module's names (pretrain.config through
    # methods/base.py, the loaders) do not need; and in this order: numba's cache first, then FFCV
    from pretrain.data.numba_cache import cache_numba_typed_dict

    cache_numba_typed_dict()                # before FFCV's import compiles its typed Dict
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter
    from tqdm import tqdm

    # FFCV's progress bar would start tqdm's monitor thread, which then lives beside every later fork of the
    # process (the next write's workers); 0 is tqdm's way to have none.
    tqdm.monitor_interval = 0

    if write_mode not in ("jpg", "raw"):
        raise ValueError(f"write_mode must be 'jpg' or 'raw', got {write_mode!r}.")
    if len(dataset) == 0:
        raise ValueError(f"Nothing to write to {out_path}: the dataset is empty.")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fields = {"image": RGBImageField(write_mode=write_mode, jpeg_quality=jpeg_quality),
              "label": IntField(), "index": IntField(), "height": IntField(), "width": IntField()}
    page_size = page_size_for(max(largest_pixels, DEFAULT_MAX_SIDE * DEFAULT_MAX_SIDE))

    with locked_partial_file(out_path) as (tmp, shared_memory_record):
        class RecordingWriter(DatasetWriter):
            """FFCV's writer, naming its shared-memory segment beside the partial file as soon as it exists: a write
            killed with its whole process group (its resource tracker too) leaves the name to the next write."""

            def prepare(self) -> None:
                super().prepare()
                shared_memory_record.write_text(self.metadata_sm.name)

        writer = RecordingWriter(str(tmp), fields, page_size=page_size, num_workers=max(1, workers))
        try:
            with children_die_with_their_parent():
                run_watching_workers_and_disk(lambda: writer.from_indexed_dataset(dataset, chunksize=64), tmp,
                                              page_size)
        except OSError:
            metadata = getattr(writer, "metadata_sm", None)      # FFCV's shared memory, which it frees on success
            if metadata is not None:
                metadata.close()
                metadata.unlink()
            raise
        os.replace(tmp, out_path)


@contextmanager
def locked_partial_file(out_path: Path) -> Iterator[tuple[Path, Path]]:
    """The partial file a .beton is written to (`.NAME.beton.partial`, renamed onto NAME.beton when complete) and
    the file that names FFCV's shared-memory segment, yielded while this process holds an exclusive lock on the
    partial file. A partial file nobody holds is what a killed write left behind: it and its shared-memory segment
    are removed, with a note. One that another process holds is a write in progress: DatasetError."""
    tmp = out_path.with_name(f".{out_path.name}.partial")
    record = out_path.with_name(f".{out_path.name}.partial.shm")
    left_behind = tmp.exists()
    handle = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DatasetError(f"another write to {out_path} is in progress (it holds {tmp}); wait for it to "
                               "finish, or write to another --out") from None
        if left_behind:
            segment = remove_shared_memory(record)
            print(f"removed {tmp}{f' and the shared memory {segment}' if segment else ''}, left by a write to "
                  f"{out_path} that was killed", file=sys.stderr, flush=True)
        record.unlink(missing_ok=True)
        yield tmp, record
    finally:
        tmp.unlink(missing_ok=True)
        record.unlink(missing_ok=True)
        os.close(handle)


def remove_shared_memory(record: Path) -> str | None:
    """Unlink the shared-memory segment named in `record` (if it is still there); return its name."""
    try:
        name = record.read_text().strip()
    except OSError:
        return None
    if not name:
        return None
    try:
        segment = shared_memory.SharedMemory(name=name)
    except (FileNotFoundError, ValueError):
        return None
    segment.close()
    segment.unlink()
    return name


def write_image_folder(image_folder: str | Path, out_path: str | Path, *, unlabeled: bool = False,
                       max_side: int | None = DEFAULT_MAX_SIDE, write_mode: str = "jpg", jpeg_quality: int = 90,
                       workers: int = 2) -> WriteReport:
    """Write an image folder (one sub-folder per class) to `out_path` (.beton); with `unlabeled`, every image of a
    folder at any depth, or of a text file listing image paths (`list_unlabeled_images`), with label -1.

    Every image is decoded once up front; unreadable or corrupt ones are skipped, counted, and listed with
    the reason in `OUT.skipped.txt` (removed when nothing was skipped). Class names go to `OUT.classes.json`
    (`[]` without labels). `max_side` shrinks larger images (longer side, aspect kept) before storing them; None
    keeps every size.
    """
    if max_side is not None and max_side < 1:
        raise ValueError(f"max_side must be a positive number of pixels, got {max_side}.")
    if not 1 <= jpeg_quality <= 100:
        raise ValueError(f"--jpeg-quality {jpeg_quality} must lie in 1-100 (JPEG's quality scale; default 90).")
    if unlabeled:
        paths = list_unlabeled_images(image_folder)
        labels, class_names = [-1] * len(paths), []
    else:
        paths, labels, class_names = list_image_folder(image_folder)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        checked = list(pool.map(_check_readable, paths))
    problems = [problem for problem, _ in checked]
    kept = [(path, label) for path, label, problem in zip(paths, labels, problems) if problem is None]
    skipped = [(str(path), problem) for path, problem in zip(paths, problems) if problem is not None]
    stored = [(stored_size(h, w, max_side), path) for (problem, (h, w)), path in zip(checked, paths) if problem is None]

    out_path = Path(out_path)
    report = WriteReport(out_path=out_path, written=len(kept), skipped=skipped, class_names=class_names)
    report_path = skipped_report_path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if skipped:
        replace_atomically(lambda tmp: tmp.write_text("".join(f"{path}\t{reason}\n" for path, reason in skipped)),
                           report_path)
    elif report_path.exists():
        report_path.unlink()
    if not kept:
        raise ValueError(f"None of the {len(paths)} images in {image_folder} could be read; reasons are in "
                         f"{report_path}.")
    (largest_h, largest_w), largest_path = max(stored, key=lambda item: item[0][0] * item[0][1])
    largest_pixels = largest_h * largest_w
    page_size_for(largest_pixels, f"{largest_path} ({largest_h} x {largest_w} px as stored)")   # refuse up front
    kept_paths = [path for path, _ in kept]
    dataset = ArrayImageSet(lambda i: read_rgb(kept_paths[i]), [label for _, label in kept], max_side)
    write_beton(out_path, dataset, write_mode=write_mode, jpeg_quality=jpeg_quality, workers=workers,
                largest_pixels=largest_pixels)
    replace_atomically(lambda tmp: tmp.write_text(json.dumps(class_names)), classes_path(out_path))
    return report
