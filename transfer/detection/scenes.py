"""The digit scenes as the detector reads them: a COCO split in memory (`SceneSplit`), written first when absent
(`prepare_scenes`), and read in a seeded random order for training (`SceneLoader`)."""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import cv2
import torch
from omegaconf import DictConfig

from pretrain.runtime.config_error import ConfigError
from transfer.detection.input_error import DetectionInputError
from transfer.digit_scenes import DigitScenesError, write_digit_scenes


@dataclass
class SceneSplit:
    """One split of a COCO detection set, in memory: uint8 images and torchvision targets."""

    json_path: Path
    image_ids: list[int]
    images: torch.Tensor                     # (N, 3, H, W) uint8
    targets: list[dict[str, torch.Tensor]]   # boxes (k, 4) float x0, y0, x1, y1; labels (k,) int64 1..K
    num_classes: int


def load_split(json_path: Path, image_folder: Path) -> SceneSplit:
    """Read a COCO instances file and its images (all of one size) into memory."""
    try:
        coco = json.loads(json_path.read_text())
        categories = sorted(category["id"] for category in coco["categories"])
        records = coco["images"]
        by_image: dict[int, list[dict]] = {record["id"]: [] for record in records}
        for annotation in coco["annotations"]:
            by_image[annotation["image_id"]].append(annotation)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DetectionInputError(f"{json_path} is not a COCO instances file ({type(error).__name__}: {error}); "
                                  "rewrite it with `python -m transfer digit-scenes --force`") from None
    if categories != list(range(1, len(categories) + 1)):
        raise DetectionInputError(f"{json_path}: category ids {categories} are not 1..K")
    images, targets = [], []
    for record in records:
        path = image_folder / record["file_name"]
        image = cv2.imread(str(path), cv2.IMREAD_COLOR)
        if image is None:
            raise DetectionInputError(f"cannot read image {path} listed in {json_path}; rewrite the set with "
                                      "`python -m transfer digit-scenes --force`")
        images.append(torch.from_numpy(cv2.cvtColor(image, cv2.COLOR_BGR2RGB)).permute(2, 0, 1))
        boxes = [[x, y, x + w, y + h] for x, y, w, h in (a["bbox"] for a in by_image[record["id"]])]
        targets.append({"boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
                        "labels": torch.tensor([a["category_id"] for a in by_image[record["id"]]], dtype=torch.int64)})
    sizes = {tuple(image.shape) for image in images}
    if len(sizes) != 1:
        raise DetectionInputError(f"{json_path}: images of several sizes {sorted(sizes)}; the digit scenes are square "
                                  "and of one size")
    return SceneSplit(json_path=json_path, image_ids=[record["id"] for record in records], images=torch.stack(images),
                      targets=targets, num_classes=len(categories))


def prepare_scenes(cfg: DictConfig) -> dict[str, Path]:
    """The digit-scenes paths of `data.root`, written first when absent (unless data.generate=false)."""
    data = cfg.data
    root = Path(data.root)
    complete = (root / "train.json").is_file() and (root / "val.json").is_file()
    if not complete and not data.generate:
        raise DetectionInputError(f"no digit scenes at {root} (train.json and val.json): write them with "
                                  f"`python -m transfer digit-scenes --out-dir {root}` or set data.generate=true")
    if not complete:
        print(f"writing the digit scenes to {root} ({data.num_train} train / {data.num_val} val, {data.image_size} px)",
              flush=True)
    try:
        return write_digit_scenes(root, num_train=data.num_train, num_val=data.num_val, image_size=data.image_size,
                                  seed=data.seed)
    except DigitScenesError as error:
        raise DetectionInputError(f"{error} (or set data.root / data.num_train / data.num_val / data.image_size to "
                                  "match the set)") from None


def batch_of(split: SceneSplit, indices: torch.Tensor, device: torch.device) -> tuple[list, list]:
    images = [split.images[i].to(device).float().div_(255) for i in indices.tolist()]
    targets = [{key: value.to(device) for key, value in split.targets[i].items()} for i in indices.tolist()]
    return images, targets


@dataclass
class SceneBatch:
    images: list[torch.Tensor]                # (3, H, W) in [0, 1]
    targets: list[dict[str, torch.Tensor]]

    @property
    def batch_size(self) -> int:
        return len(self.images)


class SceneLoader:
    """The training scenes in a seeded random order, a new permutation every epoch: epoch e's is the (e+1)-th draw
    of one generator seeded with `seed`, so a resumed run reads what the uninterrupted one read. Each rank takes its
    share of every global batch of batch_size x world_size scenes; an epoch holds len(split) // that many batches
    (at least one, a partial one when the set is smaller than a batch)."""

    def __init__(self, split: SceneSplit, batch_size: int, seed: int, rank: int, world_size: int,
                 device: torch.device):
        self.split, self.batch_size, self.seed = split, batch_size, seed
        self.rank, self.world_size, self.device = rank, world_size, device
        self.num_images = len(split.image_ids)
        if world_size > 1 and self.num_images < batch_size * world_size:
            raise ConfigError(f"{self.num_images} training scenes do not fill one batch of data.batch_size="
                              f"{batch_size} on each of {world_size} processes: lower data.batch_size")

    def __len__(self) -> int:
        return max(self.num_images // (self.batch_size * self.world_size), 1)

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[SceneBatch]:
        generator = torch.Generator().manual_seed(self.seed)
        for _ in range(epoch + 1):
            order = torch.randperm(self.num_images, generator=generator)
        for batch in range(start_batch, len(self)):
            start = (batch * self.world_size + self.rank) * self.batch_size
            yield SceneBatch(*batch_of(self.split, order[start:start + self.batch_size], self.device))
