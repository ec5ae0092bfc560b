"""N-view training loader and evaluation image loader.

`build_view_loader` returns a `ViewLoader` that yields `ViewBatch`es: every image decoded once, all its views
drawn from that one decode. Two backends share the ordering rules:

- "ffcv" (default): a `.beton` written by `python -m pretrain.data`; decode to a canvas in FFCV's numba
  pipeline, views drawn batched in torch on the training device (`pretrain.data.augment`).
- "torchvision": an image folder (one sub-folder per class), PIL decode + per-view torchvision transforms in
  DataLoader workers, the classic CPU pipeline (for comparison and for users without FFCV).

Order of an epoch (both backends): a permutation of all images from a torch.Generator seeded with
(seed, epoch), identical on every rank; rank r takes perm[r::world_size] truncated to the same length on
every rank (disjoint shards), then consecutive batches; an epoch holds a whole number of optimizer steps
(`batches_per_step`, the gradient-accumulation micro-batches): the incomplete last step is left out, so no
step mixes two epochs. `epoch(e, start_batch=k)` continues that order at batch k without decoding the first
k batches. Augmentation randomness is seeded per batch (FFCV: from (seed, rank, epoch, batch)) or per image
(torchvision: from (seed, epoch, image)), so a resumed epoch draws exactly the views of an uninterrupted one.

A class-aware batch design (`data.batch_design`: the p-random and (m, n)-group designs of paper 001,
pretrain/data/batch_designs.py) replaces the permutation: each global batch is drawn from (seed, epoch,
batch) and every rank reads its slice of it, so the same rules of resumption hold.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from pretrain.data import DatasetError
from pretrain.data.augment import augment_views, canvas_to_device, normalise
from pretrain.data.batch_designs import BatchDesign, ClassAwareBatches, dataset_labels
from pretrain.data.seeding import seeded_generator
from pretrain.data.views import ViewBatch, ViewGroup
from pretrain.data.writer import list_image_folder

# Each backend's module is imported where that backend is used ("heavy:" below): pretrain.data.ffcv_loader loads
# FFCV and numba (seconds), pretrain.data.torchvision_loader torchvision, and pretrain.config imports this module
# (IMAGENET_MEAN, IMAGENET_STD) for `python -m pretrain --help` and every config load, which need neither.

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
BACKENDS = ("ffcv", "torchvision")


def rank_epoch_order(num_images: int, seed: int, epoch: int, rank: int, world_size: int) -> np.ndarray:
    """This rank's ordered dataset indices for `epoch` (see the module docstring), as int64."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"Need 0 <= rank < world_size, got rank={rank}, world_size={world_size}.")
    permutation = torch.randperm(num_images, generator=seeded_generator(seed, epoch)).numpy()
    per_rank = num_images // world_size
    return permutation[rank::world_size][:per_rank].astype(np.int64)


class ViewLoader:
    """Yields `ViewBatch`es for one rank, epoch by epoch. Build it with `build_view_loader`.

    num_images: images the loader draws from: the whole dataset, or the `subset` of dataset indices when one
    is given (the epoch order then permutes the subset); len(loader): batches per epoch for this rank.
    """

    def __init__(self, num_images: int, groups: list[ViewGroup], batch_size: int, *, device: torch.device,
                 mean: Sequence[float], std: Sequence[float], seed: int, rank: int, world_size: int,
                 drop_last: bool, batches_per_step: int = 1, subset: Sequence[int] | None = None):
        if batch_size < 1 or batches_per_step < 1:
            raise ValueError(f"batch_size and batches_per_step must be >= 1, got {batch_size} and {batches_per_step}.")
        if not groups:
            raise ValueError("groups is empty; pass at least one ViewGroup, e.g. [ViewGroup(count=2, size=32)].")
        self.subset = None if subset is None else np.asarray(subset, dtype=np.int64)
        if self.subset is not None:
            if len(self.subset) and not (0 <= self.subset.min() and self.subset.max() < num_images):
                raise ValueError(f"subset holds dataset indices outside [0, {num_images}): the dataset has "
                                 f"{num_images} images")
            num_images = len(self.subset)
        self.num_images = num_images
        self.groups = list(groups)
        self.batch_size = batch_size
        self.device = device
        self.mean, self.std = tuple(mean), tuple(std)
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.drop_last = drop_last
        self.batches_per_step = batches_per_step
        self.samples_per_rank = num_images // world_size
        if self.samples_per_rank == 0:
            raise ValueError(f"The dataset has {num_images} images, fewer than world_size={world_size}.")
        self.class_aware: ClassAwareBatches | None = None

    def use_batch_design(self, batches: ClassAwareBatches) -> None:
        """Draw every epoch's batches from a class-aware design (over the labels of the images this loader
        draws from, the subset's when there is one); this rank reads its slice of each."""
        if batches.global_batch != self.batch_size * self.world_size:
            raise ValueError(f"the design draws global batches of {batches.global_batch} images, but this loader reads "
                             f"{self.batch_size} x {self.world_size} processes")
        if batches.design.name == "p_random" and self.batch_size % 2:
            raise ValueError(f"the p-random design keeps each pair on one process: data.batch_size="
                             f"{self.batch_size} (per process) must be even")
        self.class_aware = batches

    def __len__(self) -> int:
        if self.class_aware is not None:    # as many batches as a pass over the data, whole steps
            batches = self.num_images // self.class_aware.global_batch
            return batches - batches % self.batches_per_step
        if self.drop_last:
            batches = self.samples_per_rank // self.batch_size
            return batches - batches % self.batches_per_step
        return -(-self.samples_per_rank // self.batch_size)

    def epoch_indices(self, epoch: int, start_batch: int = 0) -> np.ndarray:
        """The ordered dataset indices this rank reads in `epoch` from batch `start_batch` on."""
        if not 0 <= start_batch <= len(self):
            raise ValueError(f"start_batch must lie in [0, {len(self)}] (batches per epoch), got {start_batch}.")
        if self.class_aware is not None:
            share = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
            shares = [self.class_aware.batch(epoch, b)[share] for b in range(start_batch, len(self))]
            order = np.concatenate(shares) if shares else np.zeros(0, dtype=np.int64)
            return order if self.subset is None else self.subset[order]
        order = rank_epoch_order(self.num_images, self.seed, epoch, self.rank, self.world_size)
        if self.subset is not None:
            order = self.subset[order]
        return order[start_batch * self.batch_size: len(self) * self.batch_size]

    def augmentation_generator(self, epoch: int, batch: int) -> torch.Generator:
        """The generator of every random draw of one batch: the same whether the epoch started at 0 or resumed."""
        return seeded_generator(self.seed, self.rank, epoch, batch)

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[ViewBatch]:
        raise NotImplementedError


class FFCVViewLoader(ViewLoader):
    """FFCV backend: one canvas decode per image, views drawn in torch on the device."""

    def __init__(self, path: str | Path, groups: list[ViewGroup], batch_size: int, *, canvas_size: int,
                 num_workers: int, **common):
        from pretrain.data.ffcv_loader import build_ffcv_loader, num_images_in  # heavy: ffcv

        super().__init__(num_images_in(path), groups, batch_size, **common)
        self.path = Path(path)
        self.canvas_size = canvas_size
        self.ffcv_loader = build_ffcv_loader(path, canvas_size, batch_size, num_workers, self.drop_last)

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[ViewBatch]:
        from pretrain.data.ffcv_loader import ffcv_batches  # heavy: ffcv

        batches = ffcv_batches(self.ffcv_loader, self.epoch_indices(epoch, start_batch))
        for batch, (canvas, labels, indices, heights, widths) in enumerate(batches, start=start_batch):
            canvas = canvas_to_device(canvas, self.device)
            source_hw = torch.stack([heights, widths], dim=1)
            views, boxes = augment_views(canvas, source_hw, self.groups, self.mean, self.std,
                                         self.augmentation_generator(epoch, batch),
                                         extent=None if self.canvas_size else source_hw)
            yield ViewBatch(views=views, boxes=boxes, labels=labels.to(self.device),
                            indices=indices.to(self.device))


class TorchvisionViewLoader(ViewLoader):
    """torchvision backend: PIL decode once per image, per-view transforms in DataLoader workers."""

    def __init__(self, path: str | Path, groups: list[ViewGroup], batch_size: int, *, num_workers: int, **common):
        from pretrain.data.torchvision_loader import ImageFolderViews  # heavy: torchvision

        self.dataset = ImageFolderViews(path, groups, common["mean"], common["std"])
        super().__init__(len(self.dataset), groups, batch_size, **common)
        self.num_workers = num_workers

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[ViewBatch]:
        ordered = self.epoch_indices(epoch, start_batch).tolist()
        if not ordered:
            return
        self.dataset.draw_seed = (self.seed, epoch)     # each image's views are drawn from (seed, epoch, image)
        from pretrain.data.torchvision_loader import worker_batches  # heavy: torchvision

        non_blocking = self.device.type == "cuda"
        for views, boxes, labels, indices in worker_batches(self.dataset, self.num_workers, batch_size=self.batch_size,
                                                            sampler=ordered, drop_last=self.drop_last,
                                                            pin_memory=self.device.type == "cuda"):
            yield ViewBatch(views=[v.to(self.device, non_blocking=non_blocking) for v in views],
                            boxes=[b.to(self.device, non_blocking=non_blocking) for b in boxes],
                            labels=labels.to(self.device), indices=indices.to(self.device))


def build_view_loader(path: str | Path, groups: list[ViewGroup], batch_size: int, *, backend: str = "ffcv",
                      device: torch.device | str = "cpu", canvas_size: int = 32,
                      mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                      num_workers: int = 2, seed: int = 0, rank: int = 0, world_size: int = 1,
                      drop_last: bool = True, batches_per_step: int = 1,
                      subset: Sequence[int] | None = None, batch_design: BatchDesign | None = None) -> ViewLoader:
    """Build the N-view loader for one rank.

    path:        a .beton from `python -m pretrain.data` (backend "ffcv") or an image folder with one
                 sub-folder per class (backend "torchvision").
    groups:      the view recipe: every image yields, per group, `count` views of `size` px.
    batch_size:  images per batch on this rank.
    canvas_size: side of the square each image is stretched to once before cropping (ffcv backend); at
                 least the source resolution keeps full detail for small crops. 0: no canvas, the views are
                 cut from each decoded image itself (a batch padded to the largest stored image), and on a
                 GPU run the host only decodes.
    mean, std:   normalisation of the views.
    seed, rank, world_size: ordering and sharding (see module docstring).
    batches_per_step: micro-batches per optimizer step; an epoch holds whole steps (with drop_last).
    subset:      dataset indices to draw from instead of every image (fine-tuning on a fraction of the labels).
    batch_design: which images form a batch (None or "uniform": the seeded permutation; "p_random" and
                 "group": pretrain/data/batch_designs.py, from the dataset's labels).
    """
    check_training_data(path, backend)
    check_view_memory(groups, batch_size)
    common = dict(device=torch.device(device), mean=mean, std=std, seed=seed, rank=rank, world_size=world_size,
                  drop_last=drop_last, batches_per_step=batches_per_step, subset=subset)
    if backend == "ffcv":
        loader = FFCVViewLoader(path, groups, batch_size, canvas_size=canvas_size, num_workers=num_workers, **common)
    else:
        loader = TorchvisionViewLoader(path, groups, batch_size, num_workers=num_workers, **common)
    if batch_design is not None and batch_design.name != "uniform":
        labels = dataset_labels(path)
        labels = labels if loader.subset is None else labels[loader.subset]
        try:
            loader.use_batch_design(ClassAwareBatches(batch_design, labels, batch_size * world_size, seed))
        except DatasetError:
            raise
        except ValueError as error:     # the design does not fit this data or batch: one line, exit status 2
            raise DatasetError(f"data.batch_design.name={batch_design.name} on {path}: {error}") from None
    return loader


def check_view_memory(groups: list[ViewGroup], batch_size: int, budget_bytes: int | None = None) -> None:
    """Raise DatasetError when one batch's views (float32, every group's count) alone would take more than
    `budget_bytes` (default: half of this machine's memory): `data.views.0.size=100000` would otherwise ask the
    allocator for terabytes at the first batch, in a traceback."""
    from pretrain.data.ffcv_loader import half_of_machine_memory  # heavy: ffcv

    needed = sum(batch_size * group.count * 3 * group.size * group.size * 4 for group in groups)
    budget = half_of_machine_memory() if budget_bytes is None else budget_bytes
    if needed > budget:
        sizes = ", ".join(f"data.views.{i}: {g.count} x {g.size} px" for i, g in enumerate(groups))
        raise DatasetError(f"one batch of {batch_size} images in views of {sizes} would take {needed / 1e9:.1f} GB, "
                           f"over {budget / 1e9:.1f} GB (half of this machine's memory): ask for smaller views "
                           "(data.views.N.size) or a smaller data.batch_size")


def check_training_data(path: str | Path, backend: str) -> None:
    """Raise DatasetError, in one line that says what to do, for training data the backend cannot read: a
    missing path, a folder for FFCV, a file that is not a complete pretrain .beton, a file for torchvision."""
    from pretrain.data.ffcv_loader import check_beton_fields  # heavy: ffcv

    path = Path(path)
    if backend not in BACKENDS:
        raise DatasetError(f"data.backend={backend!r} is not one of {BACKENDS}")
    if not path.exists():
        raise DatasetError(f"data.train={str(path)!r} does not exist: write it first with `python -m pretrain.data "
                           "write --image-folder DIR --out FILE.beton` (or `python -m pretrain.data write-digits "
                           "--out-dir data/digits`)")
    if backend == "ffcv":
        if path.is_dir():
            raise DatasetError(f"data.train={str(path)!r} is a folder, but data.backend=ffcv reads a .beton: write one "
                               f"with `python -m pretrain.data write --image-folder {path} --out OUT.beton`, or set "
                               "data.backend=torchvision to read the folder directly")
        check_beton_fields(path)
    elif not path.is_dir():
        raise DatasetError(f"data.train={str(path)!r} is a file, but data.backend=torchvision reads an image folder "
                           "(one sub-folder per class); for a .beton set data.backend=ffcv")
    else:
        try:
            list_image_folder(path)                 # no class folders or no images: said now, not at a batch
        except ValueError as error:
            raise DatasetError(f"data.train={str(path)!r}: {error}") from None


def check_held_out_data(path: str | Path) -> None:
    """Raise DatasetError for a `data.val` that is missing or not a complete .beton. Pretraining does not read it,
    but every evaluation of the run does (`eval knn --run`, the watcher, fine-tuning): a typo is said at the start,
    not after the training it was meant to evaluate."""
    from pretrain.data.ffcv_loader import check_beton_fields  # heavy: ffcv

    if not Path(path).exists():
        raise DatasetError(f"data.val={str(path)!r} does not exist: the run's evaluations read it; write it with "
                           "`python -m pretrain.data write --image-folder DIR --out FILE.beton`, or pass the held-out "
                           "set you have with data.val=PATH")
    if Path(path).is_file():
        check_beton_fields(path)


class ImageLoader:
    """Evaluation images from a .beton, in dataset order, every image once (no drop_last): the shorter side
    resized to image_size / crop_fraction, then the centre image_size x image_size crop (FFCV's
    CenterCropRGBImageDecoder crops the centred square of side crop_fraction * shorter side from the full-
    resolution decode and resizes it: the same thing, without an intermediate image).

    Iterating yields (images float (B, 3, S, S), labels (B,), indices (B,)) on the device.
    """

    def __init__(self, path: str | Path, image_size: int, batch_size: int, *, device: torch.device,
                 mean: Sequence[float], std: Sequence[float], num_workers: int, crop_fraction: float):
        from pretrain.data.ffcv_loader import build_ffcv_centre_crop_loader, num_images_in  # heavy: ffcv

        self.num_images = num_images_in(path)
        self.batch_size, self.device = batch_size, device
        self.mean, self.std = tuple(mean), tuple(std)
        self.ffcv_loader = build_ffcv_centre_crop_loader(path, image_size, crop_fraction, batch_size, num_workers)

    def __len__(self) -> int:
        return -(-self.num_images // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        from pretrain.data.ffcv_loader import ffcv_batches  # heavy: ffcv

        for crops, labels, indices in ffcv_batches(self.ffcv_loader, np.arange(self.num_images)):
            images = canvas_to_device(crops, self.device).permute(0, 3, 1, 2).float().div_(255)
            yield normalise(images.contiguous(), self.mean, self.std), labels.to(self.device), indices.to(self.device)


class TorchvisionImageLoader:
    """The same output as `ImageLoader`, from an image folder through a torch DataLoader (no FFCV)."""

    def __init__(self, path: str | Path, image_size: int, batch_size: int, *, device: torch.device,
                 mean: Sequence[float], std: Sequence[float], num_workers: int, crop_fraction: float):
        from pretrain.data.torchvision_loader import ImageFolderImages  # heavy: torchvision

        self.dataset = ImageFolderImages(path, image_size, mean, std, crop_fraction)
        self.num_images, self.batch_size, self.device = len(self.dataset), batch_size, device
        self.num_workers = num_workers

    def __len__(self) -> int:
        return -(-self.num_images // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        from pretrain.data.torchvision_loader import worker_batches  # heavy: torchvision

        for images, labels, indices in worker_batches(self.dataset, self.num_workers, batch_size=self.batch_size,
                                                      shuffle=False):
            yield images.to(self.device), labels.to(self.device), indices.to(self.device)


def build_image_loader(path: str | Path, image_size: int, batch_size: int, *, device: torch.device | str = "cpu",
                       mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                       num_workers: int = 2, crop_fraction: float = 0.875) -> ImageLoader | TorchvisionImageLoader:
    """Evaluation loader (k-NN, linear probe, transfer) over ALL images in dataset order, no augmentation: the
    standard resize of the shorter side to image_size / crop_fraction and centre crop of image_size (0.875:
    256 -> 224). `path` is a .beton (FFCV) or an image folder with one sub-folder per class (torchvision, for
    users without FFCV); both give the same crops up to interpolation."""
    if image_size < 1 or batch_size < 1:
        raise ValueError(f"image_size and batch_size must be >= 1, got {image_size} and {batch_size}.")
    if not 0 < crop_fraction <= 1:
        raise ValueError(f"crop_fraction={crop_fraction} must lie in (0, 1]: 0.875 crops 224 of 256, 1.0 keeps the "
                         "whole of a square image")
    common = dict(device=torch.device(device), mean=mean, std=std, num_workers=num_workers, crop_fraction=crop_fraction)
    if Path(path).is_dir():
        return TorchvisionImageLoader(path, image_size, batch_size, **common)
    return ImageLoader(path, image_size, batch_size, **common)
