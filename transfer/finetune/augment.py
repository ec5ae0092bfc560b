"""What fine-tuning recipes add to the loader's RandomResizedCrop + flip, all of it timm's own code, applied to a
batch in DeiT's order (Touvron et al. 2021; timm's transforms_imagenet_train then Mixup):

    crops (normalised, on the device) -> RandAugment (per image, PIL, CPU) -> random erasing (per image)
        -> mixup / cutmix (the batch, soft targets with label smoothing) -> the loss

and the loss that goes with the targets: timm's SoftTargetCrossEntropy for mixed (soft) targets, torch's cross
entropy with `label_smoothing` for class labels. Every random draw here uses Python's, numpy's and torch's
global generators; the training loop seeds them per batch (`seed_batch_generators`), so a resumed run draws what
the uninterrupted one would have.
"""
from __future__ import annotations

import random
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from PIL import Image
from timm.data import Mixup
from timm.data.auto_augment import rand_augment_transform
from timm.data.random_erasing import RandomErasing
from timm.loss import SoftTargetCrossEntropy

from pretrain.data.augment import normalise
from pretrain.data.seeding import seeded_generator
from transfer.finetune.config import mixup_enabled


def seed_batch_generators(*keys: int) -> None:
    """Seed Python's, numpy's and torch's global generators from `keys` (seed, rank, epoch, batch): timm's
    RandAugment, RandomErasing and Mixup and the backbone's drop path draw from them."""
    seed = seeded_generator(*keys).initial_seed()
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


class BatchAugmentation:
    """RandAugment, random erasing and mixup / cutmix as `cfg.augment` and `cfg.mixup` ask (each optional), and the
    matching loss. `mean` / `std`: the normalisation of the loader's crops (RandAugment works on pixels)."""

    def __init__(self, cfg: DictConfig, num_classes: int, image_size: int, mean: Sequence[float],
                 std: Sequence[float], device: torch.device):
        self.mean, self.std = tuple(mean), tuple(std)
        self.label_smoothing = cfg.loss.label_smoothing
        self.rand_augment = None
        if cfg.augment.randaugment:
            # The hyper-parameters timm's create_transform passes (translations relative to the image, the
            # dataset mean as fill colour).
            hparams = {"translate_const": int(image_size * 0.45),
                       "img_mean": tuple(min(255, round(255 * m)) for m in self.mean)}
            self.rand_augment = rand_augment_transform(cfg.augment.randaugment, hparams)
        self.random_erasing = None
        if cfg.augment.random_erasing > 0:
            self.random_erasing = RandomErasing(cfg.augment.random_erasing, mode="pixel", device=device)
        self.mixup = None
        if mixup_enabled(cfg):
            self.mixup = Mixup(mixup_alpha=cfg.mixup.mixup_alpha, cutmix_alpha=cfg.mixup.cutmix_alpha,
                               prob=cfg.mixup.prob, switch_prob=cfg.mixup.switch_prob, mode="batch",
                               label_smoothing=self.label_smoothing, num_classes=num_classes)
            self.soft_target_loss = SoftTargetCrossEntropy()

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """images (B, 3, H, W) normalised, labels (B,) -> (augmented images, targets): class labels, or (B, classes)
        soft targets under mixup / cutmix."""
        if self.rand_augment is not None:
            images = self.rand_augment_batch(images)
        if self.random_erasing is not None:
            images = self.random_erasing(images)
        if self.mixup is not None:
            return self.mixup(images, labels)
        return images, labels

    def rand_augment_batch(self, images: torch.Tensor) -> torch.Tensor:
        """timm's RandAugment on every image, as 8-bit PIL images on the CPU (its operations are PIL's)."""
        mean = torch.tensor(self.mean, device=images.device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, device=images.device).view(1, 3, 1, 1)
        pixels = (images.float() * std + mean).clamp_(0, 1).mul_(255).round_().to(torch.uint8)
        pixels = pixels.permute(0, 2, 3, 1).cpu().numpy()
        augmented = np.stack([np.asarray(self.rand_augment(Image.fromarray(image))) for image in pixels])
        result = torch.from_numpy(augmented).to(images.device).permute(0, 3, 1, 2).float().div_(255)
        return normalise(result.contiguous(), self.mean, self.std)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross entropy of `logits` (B, classes) against the targets `__call__` returned."""
        if targets.dim() == 2:
            return self.soft_target_loss(logits, targets)
        return F.cross_entropy(logits, targets, label_smoothing=self.label_smoothing)
