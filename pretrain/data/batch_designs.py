"""Class-aware batch designs: which images form each (global) mini-batch.

Hong, Park & Kim, "Deep Metric Learning via Weighted Contrastive Loss" (paper 001), section 4:

- "uniform": the loader's default, a seeded permutation cut into batches (pretrain/data/loader.py). Every
  ordered pair of distinct images is equally likely: Q = P_U, importance weight 1.
- "p_random" (sec. 4.1): the batch is B/2 pairs. Each pair is positive with probability p: one class drawn
  uniformly from the L classes, then an ordered pair of two distinct images of it; otherwise negative: an
  ordered pair of distinct classes drawn uniformly, one image of each. The pair of batch positions
  (2t, 2t + 1) is the t-th pair (images may repeat within a batch). Eq. 8 gives Q of an ordered pair.
- "group" (sec. 4.2, the (m, n)-group design): n classes drawn uniformly without replacement, m images of
  each without replacement; the batch is class-major (the m images of the first class, then the next) and
  every ordered pair of its m n images is a pair. Eq. 9 gives Q.

Every batch is drawn from a generator seeded by (seed, epoch, batch index): the order of an epoch is a
pure function of those, so an epoch resumed at batch k continues exactly as it would have. The global batch
is data.batch_size x processes images; process r takes its slice r (pairs of the p-random design stay
together: the per-process batch must be even). An epoch holds as many batches as a pass over the data
would (images // global batch), trimmed to whole optimizer steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pretrain.data.writer import FIELD_NAMES, list_image_folder

DESIGNS = ("uniform", "p_random", "group")
# Mixed into every batch's seed so that the design's draws are a stream of their own, apart from the
# augmentation generators the loader seeds with (seed, rank, epoch, batch).
BATCH_DESIGN_STREAM = 1001


@dataclass
class BatchDesign:
    """The `data.batch_design` section of the config."""

    name: str = "uniform"               # uniform | p_random | group
    positive_fraction: float = 0.5      # p of the p-random design: the share of positive pairs
    images_per_class: int = 4           # m of the (m, n)-group design; n = global batch / m classes per batch


def check_batch_design(design: BatchDesign) -> None:
    """Raise ValueError, naming the setting, for a design that cannot be drawn."""
    if design.name not in DESIGNS:
        raise ValueError(f"name={design.name!r} is not one of {DESIGNS}")
    if design.name == "p_random" and not 0 < design.positive_fraction < 1:
        raise ValueError(f"positive_fraction={design.positive_fraction} must lie in (0, 1) (paper 001 uses 0.1-0.9; "
                         "its importance weights divide by p and 1 - p)")
    if design.name == "group" and design.images_per_class < 2:
        raise ValueError(f"images_per_class={design.images_per_class} must be at least 2: a class with one image "
                         "in the batch has no positive pair")


def classes_per_batch(design: BatchDesign, global_batch: int) -> int:
    """n of the (m, n)-group design: the global batch over m (which must divide it)."""
    if global_batch % design.images_per_class:
        raise ValueError(f"the (m, n)-group design needs the global batch ({global_batch} images: data.batch_size x "
                         f"processes) to be a multiple of data.batch_design.images_per_class="
                         f"{design.images_per_class}")
    return global_batch // design.images_per_class


def dataset_labels(path: str | Path) -> np.ndarray:
    """The class label of every image of a training set, in dataset order: a .beton's label field (read
    from its metadata, no image is decoded) or an image folder's sub-folder index."""
    path = Path(path)
    if path.is_dir():
        return np.asarray(list_image_folder(path)[1], dtype=np.int64)
    from pretrain.data.ffcv_loader import check_beton_fields  # heavy: ffcv; pretrain.config imports this module

    reader = check_beton_fields(path)
    return np.asarray(reader.metadata[f"f{FIELD_NAMES.index('label')}"], dtype=np.int64)


def class_counts(labels: np.ndarray) -> np.ndarray:
    """N_c of every class label 0 .. max(labels)."""
    if len(labels) == 0 or labels.min() < 0:
        raise ValueError("class-aware batch designs need a class label for every image; this dataset has label -1 "
                         "(unknown): write it from an image folder with one sub-folder per class")
    return np.bincount(labels)


class ClassAwareBatches:
    """The global batches of the p-random or (m, n)-group design over a labelled dataset."""

    def __init__(self, design: BatchDesign, labels: np.ndarray, global_batch: int, seed: int):
        check_batch_design(design)
        if design.name == "uniform":
            raise ValueError("the uniform design is the loader's own order; ClassAwareBatches draws p_random or group")
        self.design, self.global_batch, self.seed = design, int(global_batch), int(seed)
        labels = np.asarray(labels, dtype=np.int64)
        counts = class_counts(labels)
        self.classes = np.flatnonzero(counts)                      # the L classes that have images
        self.counts = counts[self.classes]
        # The images of class classes[c] are by_class[offsets[c]:offsets[c] + counts[c]], in dataset order.
        self.by_class = np.argsort(labels, kind="stable")
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)[:-1]])
        if len(self.classes) < 2:
            raise ValueError(f"a class-aware batch design needs at least 2 classes; the dataset has "
                             f"{len(self.classes)}")
        if design.name == "p_random":
            if self.global_batch % 2:
                raise ValueError(f"the p-random design draws pairs: the global batch ({self.global_batch}) must be "
                                 "even")
            self.require_images(2, "positive pairs of two distinct images")
        else:
            n = classes_per_batch(design, self.global_batch)
            if not 2 <= n <= len(self.classes):
                raise ValueError(f"the ({design.images_per_class}, {n})-group design draws n = {n} classes per batch "
                                 f"(global batch {self.global_batch} / images_per_class {design.images_per_class}); "
                                 f"it needs 2 <= n <= {len(self.classes)}, the classes of the dataset")
            self.require_images(design.images_per_class, f"{design.images_per_class} distinct images per class")

    def require_images(self, minimum: int, what: str) -> None:
        small = self.counts < minimum
        if small.any():
            c = int(self.classes[np.argmax(small)])
            raise ValueError(f"class {c} has {int(self.counts[np.argmax(small)])} images, but the "
                             f"{self.design.name} design draws {what}; every class needs at least {minimum}")

    def generator(self, epoch: int, batch: int) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence([self.seed, int(epoch), int(batch), BATCH_DESIGN_STREAM]))

    def batch(self, epoch: int, batch: int) -> np.ndarray:
        """(global batch,) dataset indices of batch `batch` of `epoch` (see the module docstring)."""
        rng = self.generator(epoch, batch)
        if self.design.name == "p_random":
            return self._p_random(rng)
        return self._group(rng)

    def _p_random(self, rng: np.random.Generator) -> np.ndarray:
        pairs = self.global_batch // 2
        num_classes = len(self.classes)
        positive = rng.random(pairs) < self.design.positive_fraction
        first_class = rng.integers(num_classes, size=pairs)
        other = rng.integers(num_classes - 1, size=pairs)
        second_class = np.where(positive, first_class, other + (other >= first_class))   # distinct when negative
        first_size, second_size = self.counts[first_class], self.counts[second_class]
        i = rng.integers(first_size)
        # A positive pair's second image is another image of the class: draw among the other N - 1.
        j = rng.integers(np.where(positive, second_size - 1, second_size))
        j = np.where(positive & (j >= i), j + 1, j)
        first = self.by_class[self.offsets[first_class] + i]
        second = self.by_class[self.offsets[second_class] + j]
        return np.stack([first, second], axis=1).reshape(-1)

    def _group(self, rng: np.random.Generator) -> np.ndarray:
        m = self.design.images_per_class
        n = self.global_batch // m
        chosen = rng.choice(len(self.classes), size=n, replace=False)
        return np.concatenate([self.by_class[self.offsets[c] + rng.choice(self.counts[c], size=m, replace=False)]
                               for c in chosen])
