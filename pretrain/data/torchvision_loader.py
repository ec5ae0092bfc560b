"""torchvision path: the classic CPU pipeline, the peer the FFCV loader is measured against.

Each sample is decoded once with PIL; then every view gets its own RandomResizedCrop (box recorded from
`RandomResizedCrop.get_params`), flip, colour jitter (probability jitter_p, torchvision's random order),
grayscale, gaussian blur, solarisation, ToTensor and normalisation, in DataLoader workers. The output has the
same shapes and box semantics as the FFCV path: per group views (n, 3, size, size) and boxes (n, 4) as
fractions of the source width / height.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from PIL import Image, ImageOps
from torchvision import transforms
from torchvision.transforms import functional as TF

from pretrain.data import DatasetError
from pretrain.data.blur import blur_kernel_size
from pretrain.data.seeding import seeded_generator
from pretrain.data.views import ViewGroup
from pretrain.data.writer import list_image_folder


def appearance_transform(group: ViewGroup, mean: Sequence[float], std: Sequence[float]) -> transforms.Compose:
    """Everything after the crop for one group: flip, jitter, grayscale, blur, solarise, tensor, normalise."""
    return transforms.Compose([
        transforms.RandomHorizontalFlip(group.flip_p),
        transforms.RandomApply([transforms.ColorJitter(group.brightness, group.contrast, group.saturation,
                                                       group.hue)], p=group.jitter_p),
        transforms.RandomGrayscale(group.grayscale_p),
        transforms.RandomApply([transforms.GaussianBlur(
            blur_kernel_size(group.size, group.blur_kernel, group.blur_sigma[1]), group.blur_sigma)], p=group.blur_p),
        transforms.RandomSolarize(128, p=group.solarize_p),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])


def open_rgb(path: Path) -> Image.Image:
    """Decode one image file to RGB, or say which file is unreadable and how to find all such files."""
    try:
        with Image.open(path) as file:
            return ImageOps.exif_transpose(file).convert("RGB")     # EXIF orientation, as the .beton writer
    except OSError as error:   # a DatasetError: the command exits 2 with this line (from a loader worker too)
        reason = " ".join(str(error).split())
        raise DatasetError(f"Cannot read {path} ({reason}); `python -m pretrain.data write` lists every unreadable "
                           f"image of a folder in OUT.skipped.txt: remove them from the folder.") from error


# A batch that no worker delivers in this long means a worker is stuck: the wait ends, naming the workers.
WORKER_BATCH_TIMEOUT_S = 300


def worker_context(start_method: str = "forkserver") -> multiprocessing.context.BaseContext:
    """How the DataLoader workers start: forked from multiprocessing's forkserver, a process of its own that imported
    torch and this module once and never ran a thread, a process group or a lock of the caller's. A worker forked
    from the caller itself inherits whatever the caller's other threads held at that moment: one such worker hung for
    good in gloo's process-group destructor (a group an earlier in-process run had dropped, freed by the worker's
    garbage collector), and threads of FFCV, tqdm or numba can leave a lock held the same way. The forkserver costs
    its start once per process (it imports torch and torchvision: 6 s on a 2-core AMD EPYC without AVX-512); each
    epoch's workers then start as fast as forked ones (docs/benchmarks.md, "How the loader's workers start").
    As with every DataLoader on macOS and Windows, a script that builds this loader at its top level needs the
    `if __name__ == "__main__":` guard (each worker imports the script's module); `python -m pretrain` has it.
    Modules another caller asked the forkserver to preload are kept (the tests preload the whole pipeline).
    `start_method="fork"`: the workers forked from the caller, as torch's default (`python -m pretrain.bench workers`
    measures both)."""
    context = multiprocessing.get_context(start_method)
    if start_method != "forkserver":
        return context
    # the forkserver's preload list as set so far (multiprocessing keeps no public getter): kept, this module added
    preloaded = getattr(multiprocessing.forkserver._forkserver, "_preload_modules", [])
    context.set_forkserver_preload(sorted({*preloaded, __name__}))
    return context


def worker_batches(dataset: torch.utils.data.Dataset, num_workers: int, start_method: str = "forkserver",
                   **options: Any) -> Iterator[Any]:
    """The batches of `torch.utils.data.DataLoader(dataset, num_workers=num_workers, **options)`, its workers started
    by `worker_context(start_method)`; a batch not delivered within WORKER_BATCH_TIMEOUT_S raises TimeoutError naming
    the workers."""
    context = {"multiprocessing_context": worker_context(start_method), "timeout": WORKER_BATCH_TIMEOUT_S}
    loader = torch.utils.data.DataLoader(dataset, num_workers=num_workers, **options,
                                         **(context if num_workers else {}))
    iterator = iter(loader)
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except RuntimeError as error:
            if not str(error).startswith("DataLoader timed out"):
                raise
            workers = ", ".join(str(worker.pid) for worker in getattr(iterator, "_workers", []))
            raise TimeoutError(f"the DataLoader workers (pid {workers}) delivered no batch in {WORKER_BATCH_TIMEOUT_S} "
                               f"s ({len(dataset)} images): a worker is stuck (py-spy dump --pid PID shows where); "
                               "data.num_workers=0 reads the images in the training process instead") from error
        yield batch


class ImageFolderImages(torch.utils.data.Dataset):
    """Image folder -> (the evaluation crop, normalised; label; index): the shorter side resized to
    image_size / crop_fraction, then the centre image_size crop, as the FFCV evaluation loader does."""

    def __init__(self, root: str | Path, image_size: int, mean: Sequence[float], std: Sequence[float],
                 crop_fraction: float = 0.875):
        self.paths, self.labels, self.class_names = list_image_folder(root)
        self.transform = transforms.Compose([transforms.Resize(round(image_size / crop_fraction), antialias=True),
                                             transforms.CenterCrop(image_size),
                                             transforms.ToTensor(), transforms.Normalize(mean, std)])

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        return self.transform(open_rgb(self.paths[index])), self.labels[index], index


class ImageFolderViews(torch.utils.data.Dataset):
    """Image folder (one sub-folder per class) -> (views per group, boxes per group, label, index)."""

    def __init__(self, root: str | Path, groups: list[ViewGroup], mean: Sequence[float], std: Sequence[float]):
        self.paths, self.labels, self.class_names = list_image_folder(root)
        self.groups = list(groups)
        self.appearance = [appearance_transform(group, mean, std) for group in self.groups]
        # (seed, epoch), set by the loader each epoch: image i's views are drawn from a generator seeded with
        # (seed, epoch, i), whichever worker decodes it and wherever the epoch (re)started.
        self.draw_seed: tuple[int, int] = (0, 0)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        # torchvision's transforms draw from torch's global generator: fork it so the caller's stays untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seeded_generator(*self.draw_seed, index).initial_seed())
            return self.draw_views(index)

    def draw_views(self, index: int):
        image = open_rgb(self.paths[index])                     # the one decode of this sample
        width, height = image.size
        group_views, group_boxes = [], []
        for group, appearance in zip(self.groups, self.appearance):
            views, boxes = [], []
            for _ in range(group.count):
                top, left, crop_h, crop_w = transforms.RandomResizedCrop.get_params(image, list(group.scale),
                                                                                    list(group.ratio))
                crop = TF.resized_crop(image, top, left, crop_h, crop_w, [group.size, group.size],
                                       transforms.InterpolationMode(group.interpolation), antialias=True)
                views.append(appearance(crop))
                boxes.append((left / width, top / height, (left + crop_w) / width, (top + crop_h) / height))
            group_views.append(torch.stack(views))
            group_boxes.append(torch.tensor(boxes, dtype=torch.float32))
        return group_views, group_boxes, self.labels[index], index
