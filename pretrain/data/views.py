"""View recipes and view batches: what the loaders produce and the training step consumes.

A *view recipe* is a list of `ViewGroup`s (e.g. SimCLR: one group of 2 x 32 px views; DINO: 2 x 224 px
global + 8 x 96 px local views). A `ViewBatch` holds, per group, a `(B, n, C, H, W)` tensor of views on
the training device and the crop box of every view in normalised source-image coordinates.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ViewGroup:
    """One group of views drawn from every image: all share an output size and augmentation recipe.

    Defaults are the SimCLR / SimSiam recipe (Chen et al. 2020; Chen & He 2021) at 32 px.
    """

    count: int = 2                      # views per image in this group
    size: int = 32                      # output side length in pixels
    scale: tuple[float, float] = (0.2, 1.0)        # RandomResizedCrop area range (fraction of the image)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)    # RandomResizedCrop aspect-ratio range (w / h, pixels)
    flip_p: float = 0.5
    jitter_p: float = 0.8
    brightness: float = 0.4
    contrast: float = 0.4
    saturation: float = 0.4
    hue: float = 0.1
    grayscale_p: float = 0.2
    blur_p: float = 0.0
    blur_sigma: tuple[float, float] = (0.1, 2.0)
    # The blur kernel's side (pretrain/data/blur.py: blur_kernel_size): "tenth" of the view, SimCLR's rule
    # (google-research/simclr data_util.py: image_size // 10), or "sigma": out to 3 x the largest sigma, the whole
    # Gaussian that PIL's GaussianBlur(radius=sigma) blurs with (DINO's and SimSiam's utils.GaussianBlur)
    blur_kernel: str = "tenth"
    solarize_p: float = 0.0
    # The filter that resizes each crop to `size`: bilinear | bicubic (DINO's DataAugmentationDINO, main_dino.py:436;
    # google-research/simclr's crop_and_resize), both antialiased. Costs: docs/benchmarks.md.
    interpolation: str = "bilinear"


@dataclass
class ViewBatch:
    """A batch of views.

    views:   per group, float tensor (B, n, 3, H, W), normalised with the dataset mean/std, on the device.
    boxes:   per group, float tensor (B, n, 4): crop box (x0, y0, x1, y1) of every view as fractions of the
             source image's width and height (so IoU between views is exact whatever the image size).
    labels:  long tensor (B,) (class labels from the .beton; -1 where unknown).
    indices: long tensor (B,) dataset indices of the images.
    """

    views: list[torch.Tensor]
    boxes: list[torch.Tensor]
    labels: torch.Tensor
    indices: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.labels.shape[0]


def pair_iou(boxes_a: torch.Tensor, boxes_b: torch.Tensor) -> torch.Tensor:
    """Intersection over union of corresponding boxes (element-wise, with broadcasting).

    boxes_a, boxes_b: (..., 4) tensors of (x0, y0, x1, y1) boxes, e.g. the normalised source-image boxes of
    a `ViewBatch`; their leading shapes must broadcast. Returns a (...) tensor in [0, 1]; two empty boxes
    give 0 rather than NaN.
    """
    if boxes_a.shape[-1] != 4 or boxes_b.shape[-1] != 4:
        raise ValueError(f"pair_iou expects boxes of shape (..., 4) as (x0, y0, x1, y1); got {tuple(boxes_a.shape)} "
                         f"and {tuple(boxes_b.shape)}. Pass ViewBatch.boxes entries or stack boxes on the last dim.")
    ax0, ay0, ax1, ay1 = boxes_a.unbind(-1)
    bx0, by0, bx1, by1 = boxes_b.unbind(-1)
    inter_w = (torch.minimum(ax1, bx1) - torch.maximum(ax0, bx0)).clamp(min=0)
    inter_h = (torch.minimum(ay1, by1) - torch.maximum(ay0, by0)).clamp(min=0)
    intersection = inter_w * inter_h
    area_a = (ax1 - ax0).clamp(min=0) * (ay1 - ay0).clamp(min=0)
    area_b = (bx1 - bx0).clamp(min=0) * (by1 - by0).clamp(min=0)
    union = area_a + area_b - intersection
    return torch.where(union > 0, intersection / union.clamp(min=torch.finfo(union.dtype).tiny), torch.zeros_like(union))
