"""Fashion-MNIST (Xiao, Rasul & Vollgraf 2017): 70,000 28 x 28 grayscale images of 10 clothing classes, the
public benchmark of this project (README, Fashion-MNIST).

Debian's package `dataset-fashion-mnist` installs the four original IDX files under FASHION_MNIST_DIR
(`make install` installs it). `write_fashion_mnist` checks them whole (magic number, dimensions, byte count,
labels in 0..9) before writing anything, then writes OUT_DIR/train.beton (60,000) and OUT_DIR/test.beton
(10,000) with raw pixels (no JPEG loss on 28 x 28), the gray value copied to R, G and B as the digits are.

Fashion-MNIST has no validation split, and a recipe chosen on the test images is chosen on what it is scored on.
So the training images are also written split in two, for searches: OUT_DIR/search_val.beton holds a sixth of each
class (10,000 images, 1,000 a class: `held_out`, fixed), OUT_DIR/search_train.beton the other 50,000. A search trains
on search_train and scores on search_val (`data.train=... data.val=...`); the table trains on train and scores on
test, which the search never saw.

IDX format (http://yann.lecun.com/exdb/mnist/): a big-endian header of 0x00 0x00, a type byte (0x08: uint8),
the number of dimensions, then one uint32 per dimension; the values follow in C order.
"""
from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path

import numpy as np

from pretrain.data import DatasetError
from pretrain.data.writer import ArrayImageSet, WriteReport, classes_path, replace_atomically, write_beton

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
INSTALL_COMMAND = "apt-get install dataset-fashion-mnist (or: make install)"
CLASS_NAMES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
               "Ankle boot"]
SIDE = 28
# split -> (images file, labels file, number of images): the dataset's own file names and sizes
SPLITS = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", 60000),
          "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz", 10000)}
IDX_UINT8 = 0x08
SEARCH_SPLITS = ("search_train", "search_val")     # the training images without, and with only, `held_out`'s
HELD_OUT_FRACTION = 6                              # a sixth of each class: 10,000 of 60,000, as many as test


def read_idx(path: str | Path, expected_shape: tuple[int, ...]) -> np.ndarray:
    """Read a (gzipped or plain) IDX file of uint8 values and check its shape; DatasetError names the file."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"{path} is missing: install Fashion-MNIST with {INSTALL_COMMAND}, or pass "
                           f"--source-dir with the four IDX files")
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as error:   # gzip.BadGzipFile is an OSError
        raise DatasetError(f"{path} is not a readable gzip file ({error}): reinstall it with "
                           f"{INSTALL_COMMAND}") from error
    header_size = 4 + 4 * len(expected_shape)
    if len(raw) < header_size or raw[0] != 0 or raw[1] != 0 or raw[2] != IDX_UINT8 or raw[3] != len(expected_shape):
        raise DatasetError(f"{path} is not an IDX file of {len(expected_shape)}-dimensional uint8 data (its magic "
                           f"number is {raw[:4].hex() or 'missing'}, expected 000008{len(expected_shape):02x}): is it "
                           f"the right file? Reinstall with {INSTALL_COMMAND}")
    shape = tuple(int(n) for n in np.frombuffer(raw, dtype=">u4", count=len(expected_shape), offset=4))
    if shape != expected_shape:
        raise DatasetError(f"{path} holds data of shape {shape}, Fashion-MNIST's is {expected_shape}: is it the "
                           f"right file? Reinstall with {INSTALL_COMMAND}")
    size = int(np.prod(shape))
    if len(raw) != header_size + size:
        raise DatasetError(f"{path} has {len(raw) - header_size} bytes of data where its header announces {size} "
                           f"(truncated or padded): reinstall it with {INSTALL_COMMAND}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header_size).reshape(shape)


def read_fashion_mnist(source_dir: str | Path = FASHION_MNIST_DIR) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every split as (images (N, 28, 28) uint8, labels (N,) int64), all four files checked."""
    source_dir = Path(source_dir)
    splits = {}
    for split, (images_file, labels_file, count) in SPLITS.items():
        images = read_idx(source_dir / images_file, (count, SIDE, SIDE))
        labels = read_idx(source_dir / labels_file, (count,)).astype(np.int64)
        if labels.max() >= len(CLASS_NAMES):
            raise DatasetError(f"{source_dir / labels_file} holds label {labels.max()}, Fashion-MNIST's are "
                               f"0..{len(CLASS_NAMES) - 1}: is it the right file? Reinstall with {INSTALL_COMMAND}")
        splits[split] = (images, labels)
    return splits


def held_out(labels: np.ndarray) -> np.ndarray:
    """The search's validation images among the training images: a sixth of each class (rounded down), drawn by a
    fixed generator, so that every checkout holds out the same ones. A boolean mask over `labels`."""
    generator = np.random.default_rng(0)
    mask = np.zeros(len(labels), dtype=bool)
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        mask[generator.choice(members, size=len(members) // HELD_OUT_FRACTION, replace=False)] = True
    return mask


def write_fashion_mnist(out_dir: str | Path, *, source_dir: str | Path = FASHION_MNIST_DIR, force: bool = False,
                        workers: int = 2, limit: int = 0) -> list[WriteReport]:
    """Write OUT_DIR/{train,test,search_train,search_val}.beton (plus their .classes.json) from the IDX files.

    All four files are read and checked before the first .beton is written, so a bad file leaves no output.
    `limit` > 0 writes only the first `limit` images of each split (tiny sets for tests; the search's splits are
    drawn from those training images). A .beton that exists already is kept unless `force` (its report then has
    written = -1): a folder written before the search's splits existed gets them, and keeps the others.
    """
    out_dir = Path(out_dir)
    targets = {split: out_dir / f"{split}.beton" for split in (*SPLITS, *SEARCH_SPLITS)}
    if not force and all(path.exists() for path in targets.values()):
        return [WriteReport(out_path=path, written=-1, class_names=CLASS_NAMES) for path in targets.values()]
    splits = {split: (images[:limit], labels[:limit]) if limit > 0 else (images, labels)
              for split, (images, labels) in read_fashion_mnist(source_dir).items()}
    images, labels = splits["train"]
    validation = held_out(labels)
    splits.update(search_train=(images[~validation], labels[~validation]),
                  search_val=(images[validation], labels[validation]))
    reports = []
    for split, (images, labels) in splits.items():
        if targets[split].exists() and not force:
            reports.append(WriteReport(out_path=targets[split], written=-1, class_names=CLASS_NAMES))
            continue
        dataset = ArrayImageSet(lambda i, images=images: np.repeat(images[i][..., None], 3, axis=2),
                                labels.tolist(), None)
        write_beton(targets[split], dataset, write_mode="raw", workers=workers)
        replace_atomically(lambda tmp: tmp.write_text(json.dumps(CLASS_NAMES)), classes_path(targets[split]))
        reports.append(WriteReport(out_path=targets[split], written=len(labels), class_names=CLASS_NAMES))
    return reports
