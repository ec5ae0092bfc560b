"""Fine-tuning on a fraction of the labels (the semi-supervised protocol: 1% / 10% of ImageNet's labels,
as in SimCLR, Chen et al. 2020, sec. 4.2): a class-balanced subset of the training set, drawn with a seed and
saved with the fine-tuning run so that a resumed run trains on exactly the same images.

Class-balanced: every class contributes the same number of images, round(fraction x images / classes) (at
least 1), or all of its images when it has fewer. Which images: the first ones of a seeded permutation of each
class, so the same (labels, fraction, seed) always give the same subset and another seed another one.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pretrain.config import ConfigError
from pretrain.data import DatasetError
from pretrain.runtime.atomic_write import write_text_atomically

SUBSET_FILE = "label_subset.json"


def class_balanced_subset(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Sorted dataset indices of a class-balanced `fraction` of the images with `labels` (see the module
    docstring); fraction 1 returns every index."""
    labels = np.asarray(labels)
    if fraction >= 1:
        return np.arange(len(labels), dtype=np.int64)
    classes = np.unique(labels)
    per_class = max(1, int(round(fraction * len(labels) / len(classes))))
    rng = np.random.default_rng(seed)
    chosen = [rng.permutation(np.flatnonzero(labels == label))[:per_class] for label in classes]
    return np.sort(np.concatenate(chosen)).astype(np.int64)


def labels_and_class_names(path: str | Path) -> tuple[np.ndarray, list[str] | None]:
    """The class label of every image of a .beton (its label field, no image decoded) or an image folder, in
    dataset order, and the class names (a .beton's OUT.classes.json, None when it has none; an image folder's
    sub-folders). `pretrain.data.batch_designs.dataset_labels` gives the labels alone; one listing of a large
    image folder here gives both."""
    from pretrain.data.writer import FIELD_NAMES, classes_path, list_image_folder

    path = Path(path)
    if path.is_dir():
        try:
            _, labels, class_names = list_image_folder(path)
        except (OSError, ValueError) as error:    # no class sub-folders, no images: say so in one line
            raise DatasetError(str(error)) from None
        return np.asarray(labels, dtype=np.int64), class_names
    from pretrain.data.ffcv_loader import check_beton_fields

    reader = check_beton_fields(path)
    labels = np.asarray(reader.metadata[f"f{FIELD_NAMES.index('label')}"], dtype=np.int64)
    names_file = classes_path(path)
    return labels, (json.loads(names_file.read_text()) if names_file.is_file() else None)


def label_subset_for_run(run_dir: Path, labels: np.ndarray, fraction: float, seed: int, write: bool) -> np.ndarray:
    """The run's subset: read from RUN_DIR/label_subset.json when the run has one (a resumed run), else drawn
    with `class_balanced_subset` and, when `write`, saved there (atomically).

    A saved subset drawn with another fraction, seed or training set is refused (ConfigError): the run's
    checkpoints were trained on it.
    """
    path = Path(run_dir) / SUBSET_FILE
    wanted = {"fraction": fraction, "seed": seed, "num_images": int(len(labels))}
    if path.is_file():
        saved = json.loads(path.read_text())
        changed = [f"{key} was {saved.get(key)} and is now {value}" for key, value in wanted.items()
                   if saved.get(key) != value]
        if changed:
            raise ConfigError(f"{path} holds the label subset this run was trained on, but " + "; ".join(changed)
                              + ": rerun with the run's settings (data.label_fraction, data.label_seed, data.train), "
                              "or fine-tune under another name=... .")
        return np.asarray(saved["indices"], dtype=np.int64)
    subset = class_balanced_subset(labels, fraction, seed)
    if write:
        path.parent.mkdir(parents=True, exist_ok=True)
        per_class = np.bincount(labels[subset]).tolist()
        write_text_atomically(path, json.dumps({**wanted, "images_per_class": per_class,
                                                "indices": subset.tolist()}) + "\n")
    return subset
