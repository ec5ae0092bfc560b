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
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np
from PIL import Image

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
FIELD_NAMES = ("image", "label", "index", "height", "width")


@dataclass
class WriteReport:
    """What a write produced: how many images went in and which were skipped (path, reason)."""

    out_path: Path
    written: int
    skipped: list[tuple[str, str]] = field(default_factory=list)
    class_names: list[str] = field(default_factory=list)

    def summary(self) -> str:
        text = f"{self.out_path}: wrote {self.written} images in {len(self.class_names)} classes"
        if self.skipped:
            text += (f", skipped {len(self.skipped)} unreadable image(s), listed in "
                     f"{skipped_report_path(self.out_path)}")
        return text


def classes_path(beton_path: str | Path) -> Path:
    """`OUT.beton` -> `OUT.classes.json`, the class names in label order."""
    return Path(beton_path).with_suffix(".classes.json")


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
                         f"{root}/<class name>/ (e.g. {root}/cat/001.jpg).")
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
    """Decode an image file to an HWC uint8 RGB array; raises OSError / ValueError on unreadable files."""
    with Image.open(path) as image:
        image.load()               # decodes fully: truncated files fail here, not at write time
        return np.asarray(image.convert("RGB"), dtype=np.uint8).copy()


def _check_readable(path: Path) -> str | None:
    """None when `path` decodes to a non-empty RGB image, else the reason it cannot be used."""
    try:
        image = read_rgb(path)
    except Exception as error:     # PIL raises many types (OSError, SyntaxError, ValueError, DecompressionBomb...)
        return f"{type(error).__name__}: {error}".replace("\n", " ").replace("\t", " ")
    if image.ndim != 3 or image.shape[0] == 0 or image.shape[1] == 0:
        return f"empty image of shape {image.shape}"
    return None


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
                jpeg_quality: int = 90, workers: int = 2) -> None:
    """Write `dataset` to `out_path` with the fields listed in the module docstring."""
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    if write_mode not in ("jpg", "raw"):
        raise ValueError(f"write_mode must be 'jpg' or 'raw', got {write_mode!r}.")
    if len(dataset) == 0:
        raise ValueError(f"Nothing to write to {out_path}: the dataset is empty.")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fields = {"image": RGBImageField(write_mode=write_mode, jpeg_quality=jpeg_quality),
              "label": IntField(), "index": IntField(), "height": IntField(), "width": IntField()}
    writer = DatasetWriter(str(out_path), fields, num_workers=max(1, workers))
    writer.from_indexed_dataset(dataset, chunksize=64)


def write_image_folder(image_folder: str | Path, out_path: str | Path, *, max_side: int | None = None,
                       write_mode: str = "jpg", jpeg_quality: int = 90, workers: int = 2) -> WriteReport:
    """Write an image folder (one sub-folder per class) to `out_path` (.beton).

    Every image is decoded once up front; unreadable or corrupt ones are skipped, counted, and listed with
    the reason in `OUT.skipped.txt` (removed when nothing was skipped). Class names go to `OUT.classes.json`.
    `max_side` shrinks larger images (longer side, aspect kept) before storing them.
    """
    if max_side is not None and max_side < 1:
        raise ValueError(f"max_side must be a positive number of pixels, got {max_side}.")
    paths, labels, class_names = list_image_folder(image_folder)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        problems = list(pool.map(_check_readable, paths))
    kept = [(path, label) for path, label, problem in zip(paths, labels, problems) if problem is None]
    skipped = [(str(path), problem) for path, problem in zip(paths, problems) if problem is not None]

    out_path = Path(out_path)
    report = WriteReport(out_path=out_path, written=len(kept), skipped=skipped, class_names=class_names)
    report_path = skipped_report_path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if skipped:
        report_path.write_text("".join(f"{path}\t{reason}\n" for path, reason in skipped))
    elif report_path.exists():
        report_path.unlink()
    if not kept:
        raise ValueError(f"None of the {len(paths)} images in {image_folder} could be read; reasons are in "
                         f"{report_path}.")
    kept_paths = [path for path, _ in kept]
    dataset = ArrayImageSet(lambda i: read_rgb(kept_paths[i]), [label for _, label in kept], max_side)
    write_beton(out_path, dataset, write_mode=write_mode, jpeg_quality=jpeg_quality, workers=workers)
    classes_path(out_path).write_text(json.dumps(class_names))
    return report
