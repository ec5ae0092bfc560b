"""The embedded default dataset: the UCI handwritten digits that ship with scikit-learn.

1797 images of 8x8 (values 0..16, 10 classes), upsampled bicubically to 32x32 RGB uint8 and split 80/20
stratified with a fixed seed, written to OUT_DIR/train.beton and OUT_DIR/val.beton (see `pretrain.data.writer`
for the fields). Real images that need no download: raw-pixel k-NN scores about 97% on them.

The deep-metric-learning split (`split_classes=True`, `write-digits --split-classes`) trains on the first
half of the classes and retrieves among the unseen second half, as CUB-200 / Cars-196 / SOP are used
(papers 000-002): OUT_DIR/train.beton holds every image of the digits 0-4 and OUT_DIR/test.beton every image
of 5-9, with their original labels (`python -m eval retrieval --split-classes` keeps labels 5-9).
"""
from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np

from pretrain.data.writer import ArrayImageSet, WriteReport, classes_path, replace_atomically, write_beton

DIGITS_SIDE = 32
DIGITS_SPLIT_SEED = 0
DIGITS_VAL_FRACTION = 0.2


def digits_images(side: int = DIGITS_SIDE) -> tuple[np.ndarray, np.ndarray]:
    """The 1797 UCI digits (scikit-learn) as (N, side, side, 3) uint8 RGB (bicubic upsampling) and (N,) labels."""
    # heavy: scikit-learn (~1.5 s); `transfer digit-scenes --help` and `launch demo --help` import this module
    from sklearn.datasets import load_digits

    digits = load_digits()
    small = (digits.images * (255.0 / 16.0)).astype(np.float32)          # 0..16 -> 0..255
    large = np.stack([cv2.resize(img, (side, side), interpolation=cv2.INTER_CUBIC) for img in small])
    large = np.clip(np.rint(large), 0, 255).astype(np.uint8)
    return np.repeat(large[..., None], 3, axis=3), digits.target.astype(np.int64)


def digits_split(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stratified 80/20 train/val split of the digits, fixed seed: (train indices, val indices) into load_digits."""
    from sklearn.model_selection import train_test_split  # heavy: scikit-learn, as in digits_images

    all_indices = np.arange(len(labels))
    train, val = train_test_split(all_indices, test_size=DIGITS_VAL_FRACTION, random_state=DIGITS_SPLIT_SEED,
                                  stratify=labels)
    return np.asarray(train), np.asarray(val)


def digits_class_split(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The DML split: (indices of every image of the first half of the classes, of the second half)."""
    half = (int(labels.max()) + 1) // 2
    return np.flatnonzero(labels < half), np.flatnonzero(labels >= half)


def write_digits(out_dir: str | Path, *, force: bool = False, write_mode: str = "jpg",
                 workers: int = 2, split_classes: bool = False) -> list[WriteReport]:
    """Write the digits to OUT_DIR/train.beton and OUT_DIR/val.beton (plus .classes.json and split.json);
    with `split_classes`, the DML split to OUT_DIR/train.beton (digits 0-4) and OUT_DIR/test.beton (5-9).

    When both .beton files exist already, nothing is rewritten unless `force`; the returned reports then
    have written = -1.
    """
    out_dir = Path(out_dir)
    second = "test" if split_classes else "val"
    targets = {"train": out_dir / "train.beton", second: out_dir / f"{second}.beton"}
    class_names = [str(digit) for digit in range(10)]
    if not force and all(path.exists() for path in targets.values()):
        return [WriteReport(out_path=path, written=-1, class_names=class_names) for path in targets.values()]
    images, labels = digits_images()
    train, val = digits_class_split(labels) if split_classes else digits_split(labels)
    out_dir.mkdir(parents=True, exist_ok=True)
    reports = []
    for split, rows in (("train", train), (second, val)):
        dataset = ArrayImageSet(lambda i, rows=rows: images[rows[i]], labels[rows].tolist(), None)
        write_beton(targets[split], dataset, write_mode=write_mode, workers=workers)
        replace_atomically(lambda tmp: tmp.write_text(json.dumps(class_names)), classes_path(targets[split]))
        reports.append(WriteReport(out_path=targets[split], written=len(rows), class_names=class_names))
    split_record = json.dumps({"train": train.tolist(), "test": val.tolist(), "split": "classes 0-4 / 5-9"}
                              if split_classes else
                              {"train": train.tolist(), "val": val.tolist(), "seed": DIGITS_SPLIT_SEED,
                               "val_fraction": DIGITS_VAL_FRACTION})
    replace_atomically(lambda tmp: tmp.write_text(split_record), out_dir / "split.json")
    return reports
