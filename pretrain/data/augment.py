"""Batched view augmentation in torch: every view of every image of a batch in a handful of tensor ops.

The FFCV loader decodes each image once into a fixed square *canvas* (the whole image stretched to
`canvas_size` x `canvas_size`). `augment_views` then draws all views of the batch from those canvases on the
training device:

1. RandomResizedCrop boxes (Szegedy et al. 2015, as in torchvision): area fraction in `scale`, aspect ratio
   (w / h) in `ratio` measured in SOURCE pixels, 10 attempts then a centre-crop fallback, exactly like
   `torchvision.transforms.RandomResizedCrop.get_params` but with continuous (not integer) coordinates.
   Boxes are returned as fractions of the source width / height.
2. Crop + resize + horizontal flip of all views of a group as two batched matmuls with antialiased
   interpolation matrices (separable; the flip is the column matrix reversed), bilinear or, with the group's
   `interpolation: bicubic`, Keys' cubic as PIL's and torch's antialiased bicubic (DINO's crops). This replaces the
   `torchvision.ops.roi_align` design: on the CPU roi_align took 17 ms (1 sample per bin, aliased) to 54 ms
   (adaptive sampling) for 1024 views 64 -> 32 px, the matmuls about 8 ms, with proper antialiasing.
   The flip is appearance only: the box stays the source region. A dense resize matrix costs size x canvas^2
   multiply-adds per view, though: on GPUs that is cheap, on CPUs at ImageNet sizes it is not (a 224 px view
   from a 384 px canvas: 0.3 GFLOP). There, views of `PER_VIEW_MIN_SIZE` px and more are cropped one by one
   and resized with PyTorch's antialiased kernel on the uint8 canvas (bilinear: vectorised for channels-last
   uint8: 10-30x faster than the matmuls for 96-224 px views, 2x at 32 px, slower only for tiny views); the
   crop box is then rounded to whole canvas pixels (the recorded box stays exact: < 1 canvas pixel apart).
   The large views land in one channel-first float batch, the layout the model reads, each coloured (step 3)
   and clamped as it is written, while it is in the cache; every later step works on the batch in place or on
   the chosen views only: no concatenation, no layout copy, no second batch. That loop runs in one thread: a
   view's operations are too small to share, and each of them woke OpenMP's sleeping team (224 px views, 2
   threads against 1 on the 2-core machine: 2.5x the CPU time, and no faster); its batch is fresh memory on huge
   pages (`pretrain/runtime/memory_reuse.py: advise_huge_pages`). The small views (the
   digits runs') keep the arithmetic their results were measured with: colour on channels-last pixels, one
   copy to channel-first, the blur as a convolution; the same values to float32 rounding, not bit for bit.
3. Colour jitter with probability `jitter_p` in a FIXED order brightness -> contrast -> saturation -> hue
   (torchvision draws a random order), then grayscale with `grayscale_p`. All five are affine maps of RGB,
   so they are composed into one per-view 3x3 matrix + offset and applied in one matmul, clamped
   to [0, 1] once at the end (torchvision clamps after every step; results differ only where an
   intermediate step saturates). Then gaussian blur (pretrain/data/blur.py), solarisation, and normalisation with
   mean / std.

Hue is shifted by rotating the chroma plane in YIQ space by `2 * pi * h` (h uniform in [-hue, hue]); this is
a linear approximation of torchvision's HSV hue shift that avoids the piecewise RGB <-> HSV conversion.

Every random parameter (boxes, flips, factors, masks) is drawn per view from one CPU `torch.Generator`, so a
batch is reproducible from the generator state whatever the device. On a GPU the host's part is that drawing,
the per-view colour matrices and the canvas copy (`canvas_to_device`); on the "meta" device only that part runs,
which is how `python -m pretrain.bench loader --sizes imagenet` measures a GPU run's host side on CPUs.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from pretrain.data.blur import blur_kernel_size, gaussian_blur_
from pretrain.data.views import ViewGroup
from pretrain.runtime.cpu_threads import one_thread_on_cpu
from pretrain.runtime.memory_reuse import advise_huge_pages

# ITU-R 601 luma weights, the ones torchvision's rgb_to_grayscale uses.
LUMA_WEIGHTS = (0.299, 0.587, 0.114)

# RGB -> YIQ (NTSC) and its inverse; hue rotation acts on the (I, Q) plane.
RGB_TO_YIQ = torch.tensor([[0.299, 0.587, 0.114],
                           [0.595716, -0.274453, -0.321263],
                           [0.211456, -0.522591, 0.311135]], dtype=torch.float64)
YIQ_TO_RGB = torch.linalg.inv(RGB_TO_YIQ)


def _uniform(low: float, high: float, count: int, generator: torch.Generator) -> torch.Tensor:
    return low + (high - low) * torch.rand(count, generator=generator, dtype=torch.float64)


def sample_crop_boxes(source_hw: torch.Tensor, scale: Sequence[float], ratio: Sequence[float],
                      generator: torch.Generator, attempts: int = 10) -> torch.Tensor:
    """RandomResizedCrop boxes for a batch of images, vectorised over images.

    source_hw: (K, 2) heights and widths of the source images in pixels (one row per view to draw).
    scale:     (min, max) area of the crop as a fraction of the image area.
    ratio:     (min, max) aspect ratio w / h of the crop in source pixels.
    Returns a (K, 4) float64 CPU tensor of boxes (x0, y0, x1, y1) as fractions of source width / height.
    """
    if not (0 < scale[0] <= scale[1] <= 1):
        raise ValueError(f"scale must satisfy 0 < min <= max <= 1, got {tuple(scale)}; e.g. use (0.2, 1.0).")
    if not (0 < ratio[0] <= ratio[1]):
        raise ValueError(f"ratio must satisfy 0 < min <= max, got {tuple(ratio)}; e.g. use (3/4, 4/3).")
    source_hw = source_hw.detach().to("cpu", torch.float64)
    count = source_hw.shape[0]
    height, width = source_hw[:, 0:1], source_hw[:, 1:2]
    area = height * width

    target_area = area * _uniform(scale[0], scale[1], count * attempts, generator).view(count, attempts)
    log_ratio = _uniform(math.log(ratio[0]), math.log(ratio[1]), count * attempts, generator).view(count, attempts)
    aspect = torch.exp(log_ratio)
    crop_w = torch.sqrt(target_area * aspect)
    crop_h = torch.sqrt(target_area / aspect)
    fits = (crop_w <= width) & (crop_h <= height)
    first_fit = fits.to(torch.uint8).argmax(dim=1, keepdim=True)
    crop_w_fit = crop_w.gather(1, first_fit).squeeze(1)
    crop_h_fit = crop_h.gather(1, first_fit).squeeze(1)

    # Fallback after `attempts` misses: the largest centred crop with the aspect ratio clamped into range.
    height, width = height.squeeze(1), width.squeeze(1)
    in_ratio = width / height
    fallback_w = torch.where(in_ratio > ratio[1], height * ratio[1], width)
    fallback_h = torch.where(in_ratio < ratio[0], width / ratio[0], height)
    any_fit = fits.any(dim=1)
    crop_w = torch.where(any_fit, crop_w_fit, fallback_w)
    crop_h = torch.where(any_fit, crop_h_fit, fallback_h)

    x_frac = torch.rand(count, generator=generator, dtype=torch.float64)
    y_frac = torch.rand(count, generator=generator, dtype=torch.float64)
    x_frac = torch.where(any_fit, x_frac, torch.full_like(x_frac, 0.5))
    y_frac = torch.where(any_fit, y_frac, torch.full_like(y_frac, 0.5))
    x0 = x_frac * (width - crop_w)
    y0 = y_frac * (height - crop_h)
    boxes = torch.stack([x0 / width, y0 / height, (x0 + crop_w) / width, (y0 + crop_h) / height], dim=1)
    return boxes.clamp_(0.0, 1.0)


def grayscale(images: torch.Tensor) -> torch.Tensor:
    """(K, 3, H, W) RGB in [0, 1] -> (K, 1, H, W) luma."""
    r, g, b = images.unbind(1)
    return (LUMA_WEIGHTS[0] * r + LUMA_WEIGHTS[1] * g + LUMA_WEIGHTS[2] * b).unsqueeze(1)


INTERPOLATIONS = ("bilinear", "bicubic")      # ViewGroup.interpolation: the filter that resizes the crops
CUBIC_A = -0.5        # Keys' cubic convolution with a = -0.5: PIL's bicubic filter, and torch's antialiased one


def cubic_filter(distance: torch.Tensor) -> torch.Tensor:
    """Keys' cubic convolution kernel (a = CUBIC_A) at distances >= 0 in filter units: 0 from 2 on."""
    a = CUBIC_A
    near = ((a + 2) * distance - (a + 3)) * distance * distance + 1
    far = ((a * distance - 5 * a) * distance + 8 * a) * distance - 4 * a
    return torch.where(distance <= 1, near, torch.where(distance < 2, far, torch.zeros_like(distance)))


def resize_weights(starts: torch.Tensor, lengths: torch.Tensor, source_size: int, output_size: int,
                   limits: torch.Tensor | None = None, interpolation: str = "bilinear") -> torch.Tensor:
    """Antialiased interpolation matrices for 1-D crops: (K,) crop starts / lengths in source pixels
    -> (K, output_size, source_size) rows that sum to 1.

    A triangle filter (bilinear) or Keys' cubic (bicubic) whose support widens with the downscale factor (as PIL's
    and torch's antialiased resize), so large crops are averaged rather than aliased. `limits` (K,): pixels from
    there on are not the view's image (a batch padded to its largest image) and get no weight, as past the edge.
    """
    step = lengths / output_size
    centres = starts[:, None] + (torch.arange(output_size, dtype=starts.dtype, device=starts.device) + 0.5) * step[:, None]
    support = step.clamp(min=1.0)[:, None, None]
    source_centres = torch.arange(source_size, dtype=starts.dtype, device=starts.device) + 0.5
    distance = (source_centres[None, None, :] - centres[:, :, None]).abs() / support
    if interpolation == "bicubic":
        weights = cubic_filter(distance)
    else:
        weights = (1 - distance).clamp_(min=0)
    if limits is not None:
        weights = weights * (source_centres[None, None, :] < limits.to(weights.dtype)[:, None, None])
    return weights / weights.sum(dim=2, keepdim=True)


PER_VIEW_MIN_SIZE = 32        # on the CPU, views this large or larger are resized one by one (module docstring)


def view_extents(canvas: torch.Tensor, extent: torch.Tensor | None, views_per_image: int) -> torch.Tensor:
    """(B * n, 2) float64 CPU height and width of each view's image on its canvas (the crop functions' extent)."""
    if extent is None:
        extent = torch.tensor([canvas.shape[1:3]]).expand(canvas.shape[0], 2)
    return extent.to("cpu", torch.float64).repeat_interleave(views_per_image, dim=0)


def crop_resize_flip_one_by_one(canvas: torch.Tensor, boxes: torch.Tensor, views_per_image: int, size: int,
                                flip: torch.Tensor, pixel_scale: float = 1.0,
                                extent: torch.Tensor | None = None, interpolation: str = "bilinear",
                                colour: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Crop, resize and flip on the CPU, for views of PER_VIEW_MIN_SIZE px and more: each box rounded to whole canvas
    pixels, cropped, and resized by `F.interpolate(mode=interpolation, antialias=True)` on the uint8 canvas when it
    is one (uint8 until the last step), then converted to float straight into its slot of one preallocated
    channel-first batch, the layout the model reads: no concatenation, no layout copy of its own.

    canvas: (B, H, W, 3) uint8 or float, channels last as decoded; boxes: (B * n, 4) CPU fractions of the image
    (rows b * n .. b * n + n - 1 belong to image b); flip: (B * n,) bool; pixel_scale multiplies every pixel
    (e.g. 1 / 255); extent: (B, 2) CPU heights and widths of the image in each canvas's top-left corner (a batch
    padded to its largest image), None when each image fills its canvas. Bicubic values are clamped to the pixel
    range, as the uint8 pixels of PIL's resize (DINO's).

    Without `colour`: returns float (B * n, 3, size, size), the pixels times pixel_scale (one `mul_` over the batch:
    `torch.mul(uint8, scale, out=float)` would fold it into the copy but takes 10x longer than `copy_`).
    With `colour`, `colour_matrices`' (M, u, luma) for every view: each view is also coloured (`colour_views`'
    x -> M x + u * mean_luma(x), the pixel scale folded into M and u) and clamped to [0, 1] as it is written,
    while its pixels are in the cache: one batch allocated instead of two, and one pass over it instead of four
    (convert, scale, colour, clamp). Without a malloc that keeps freed memory (HARDVIEW_MALLOC=reuse) each new
    batch is paid for again in page faults, so the batch not allocated is time saved too.
    """
    planes = canvas.permute(0, 3, 1, 2)                    # (B, 3, H, W) with channels-last memory, no copy
    heights, widths = view_extents(canvas, extent, views_per_image).unbind(1)
    pixels = (boxes.to(torch.float64) * torch.stack([widths, heights, widths, heights], dim=1)).round().long()
    views = advise_huge_pages(torch.empty(boxes.shape[0], 3, size, size))     # written in full below
    saturate = interpolation == "bicubic" and canvas.dtype != torch.uint8   # a uint8 resize saturates by itself
    if colour is not None:
        matrix, mean_coefficient, luma = colour
        matrix, mean_coefficient = (matrix * pixel_scale).float(), (mean_coefficient * pixel_scale).float()
        luma = luma.float()
        scratch = torch.empty(1, 3, size * size)           # one view's float pixels, reused: stays in the cache
    for k, ((x0, y0, x1, y1), mirrored) in enumerate(zip(pixels.tolist(), flip.tolist())):
        x1, y1 = max(x1, x0 + 1), max(y1, y0 + 1)
        image = k // views_per_image
        resized = F.interpolate(planes[image:image + 1, :, y0:y1, x0:x1], size=(size, size), mode=interpolation,
                                antialias=True, align_corners=False)[0]
        resized = resized.flip(-1) if mirrored else resized
        if colour is None:
            views[k].copy_(resized)                        # uint8 channels-last -> float channel-first
            continue
        float_pixels = scratch.view(3, size, size).copy_(resized)
        if saturate:
            float_pixels.clamp_(0, 1 / pixel_scale)
        offset = mean_coefficient[k] * (scratch[0].mean(dim=1) @ luma)
        slot = views[k].view(1, 3, size * size)
        torch.baddbmm(offset.view(1, 3, 1), matrix[k:k + 1], scratch, out=slot).clamp_(0, 1)
    if colour is not None:
        return views
    if saturate:
        views.clamp_(0, 1 / pixel_scale)
    return views.mul_(pixel_scale) if pixel_scale != 1 else views


def crop_resize_flip_by_matmuls(canvas: torch.Tensor, boxes: torch.Tensor, views_per_image: int, size: int,
                                flip: torch.Tensor, pixel_scale: float = 1.0,
                                extent: torch.Tensor | None = None, interpolation: str = "bilinear") -> torch.Tensor:
    """Crop, resize and flip as two batched matmuls (GPUs, and small views on the CPU), the arguments as
    `crop_resize_flip_one_by_one`'s; bicubic values clamped to [0, 1]. Separable: one batched
    matmul over canvas rows (the n views of an image share its canvas, no copy), one over columns (the flip is
    the column matrix reversed), instead of a gather + sampler. The interpolation matrices are built on the
    canvas's device: on a GPU run the host sends the boxes, not (views x size x canvas) weights.
    Returns float (B * n, y, x, 3), channels last."""
    canvas = canvas.float()
    batch, canvas_h, canvas_w, channels = canvas.shape
    view_count = boxes.shape[0]
    boxes = boxes.to(canvas.device, torch.float32)
    extent = view_extents(canvas, extent, views_per_image)
    heights, widths = extent.to(canvas.device, torch.float32).unbind(1)
    padded = bool((extent[:, 0] < canvas_h).any() or (extent[:, 1] < canvas_w).any())
    rows = resize_weights(boxes[:, 1] * heights, (boxes[:, 3] - boxes[:, 1]) * heights, canvas_h, size,
                          heights if padded else None, interpolation)
    cols = resize_weights(boxes[:, 0] * widths, (boxes[:, 2] - boxes[:, 0]) * widths, canvas_w, size,
                          widths if padded else None, interpolation)
    cols = torch.where(flip.to(canvas.device).view(-1, 1, 1), cols.flip(1), cols)
    rows = (rows * pixel_scale).view(batch, views_per_image * size, canvas_h)
    resized_rows = torch.bmm(rows, canvas.reshape(batch, canvas_h, canvas_w * channels))  # (B, n * y, S * 3)
    resized_rows = (resized_rows.view(view_count, size, canvas_w, channels)
                    .transpose(1, 2).reshape(view_count, canvas_w, size * channels))
    views = torch.bmm(cols, resized_rows)                                                  # (B * n, x, y * 3)
    if interpolation == "bicubic":
        views.clamp_(0, 1)                      # the cubic's overshoot, as a uint8 resize saturates
    return views.view(view_count, size, size, channels).transpose(1, 2)                   # (B * n, y, x, 3)


def colour_matrices(brightness: torch.Tensor, contrast: torch.Tensor, saturation: torch.Tensor,
                    hue: torch.Tensor, to_gray: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-view affine colour transform equal to brightness -> contrast -> saturation -> hue -> optional
    grayscale, each as defined by torchvision's adjust_* functions but without the clamp between steps (one
    clamp at the end). All five are affine in RGB, so their composition is x -> M x + u * mean_luma(view),
    where mean_luma is the view's mean luma (contrast blends towards it).

    brightness, contrast, saturation: (K,) factors, 1 = unchanged; hue: (K,) shift in turns, applied as a
    rotation of the YIQ chroma plane; to_gray: (K,) bool.
    Returns M (K, 3, 3), u (K, 3) and the luma weights (3,) (float64, CPU).
    """
    dtype = torch.float64
    count = brightness.shape[0]
    luma = torch.tensor(LUMA_WEIGHTS, dtype=dtype)
    identity = torch.eye(3, dtype=dtype).expand(count, 3, 3)
    to_luma = torch.ones(3, 1, dtype=dtype) @ luma[None, :]                 # x -> gray(x) in every channel
    brightness, contrast, saturation = (v.to(dtype).view(-1, 1, 1) for v in (brightness, contrast, saturation))

    angle = hue.to(dtype) * (2 * math.pi)
    cos, sin = torch.cos(angle), torch.sin(angle)
    rotation = torch.zeros(count, 3, 3, dtype=dtype)
    rotation[:, 0, 0] = 1
    rotation[:, 1, 1], rotation[:, 1, 2] = cos, -sin
    rotation[:, 2, 1], rotation[:, 2, 2] = sin, cos
    hue_matrix = YIQ_TO_RGB @ rotation @ RGB_TO_YIQ

    saturation_matrix = saturation * identity + (1 - saturation) * to_luma
    gray_matrix = torch.where(to_gray.view(-1, 1, 1), to_luma.expand(count, 3, 3), identity)
    after_contrast = gray_matrix @ hue_matrix @ saturation_matrix
    matrix = after_contrast * (contrast * brightness)
    # contrast: b x -> c (b x) + (1 - c) * mean_luma(b x) = c b x + (1 - c) b mean_luma(x)
    mean_coefficient = (after_contrast @ torch.ones(3, 1, dtype=dtype)).squeeze(2) * ((1 - contrast) * brightness).view(-1, 1)
    return matrix, mean_coefficient, luma


def colour_views(views: torch.Tensor, matrix: torch.Tensor, mean_coefficient: torch.Tensor,
                 luma: torch.Tensor) -> torch.Tensor:
    """x -> M x + u * mean_luma(view) (`colour_matrices`) for every view (K, 3, H, W), as one batched 3 x 3 matmul
    on channels-last pixels (K, H * W, 3), into a new tensor: the batched matmuls' views (GPUs, the CPU's small
    views), in the arithmetic the digits results were measured with. The CPU's large views are coloured one by one
    as they are written (`crop_resize_flip_one_by_one`), in the same arithmetic to float32 rounding.
    """
    count, _, height, width = views.shape
    device, dtype = views.device, views.dtype
    matrix, luma = matrix.to(device, dtype), luma.to(device, dtype)
    pixels = views.permute(0, 2, 3, 1).reshape(count, height * width, 3)        # a view of channels-last memory
    offset = mean_coefficient.to(device, dtype) * (pixels.mean(dim=1) @ luma)[:, None]
    coloured = torch.baddbmm(offset.unsqueeze(1), pixels, matrix.transpose(1, 2))
    return coloured.view(count, height, width, 3).permute(0, 3, 1, 2)


def check_view_group(group: ViewGroup) -> None:
    """Raise ValueError naming the first field of `group` that no view can be drawn with."""
    if group.count < 1 or group.size < 1:
        raise ValueError(f"ViewGroup needs count >= 1 and size >= 1, got count={group.count}, size={group.size}.")
    for name in ("flip_p", "jitter_p", "grayscale_p", "blur_p", "solarize_p"):
        value = getattr(group, name)
        if not 0 <= value <= 1:
            raise ValueError(f"ViewGroup.{name} is a probability and must lie in [0, 1], got {value}.")
    if group.interpolation not in INTERPOLATIONS:
        raise ValueError(f"ViewGroup.interpolation={group.interpolation!r} is not one of {INTERPOLATIONS} (the filter "
                         "that resizes the crops; DINO's recipe: bicubic).")
    if not 0 <= group.hue <= 0.5:
        raise ValueError(f"ViewGroup.hue must lie in [0, 0.5] (turns), got {group.hue}.")
    for name in ("brightness", "contrast", "saturation"):
        if not getattr(group, name) >= 0:
            raise ValueError(f"ViewGroup.{name} must be >= 0, got {getattr(group, name)}.")
    scale, ratio, sigma = tuple(group.scale), tuple(group.ratio), tuple(group.blur_sigma)
    if len(scale) != 2 or not 0 < scale[0] <= scale[1] <= 1:
        raise ValueError(f"ViewGroup.scale must satisfy 0 < min <= max <= 1, got {scale}; e.g. use [0.2, 1.0].")
    if len(ratio) != 2 or not 0 < ratio[0] <= ratio[1]:
        raise ValueError(f"ViewGroup.ratio must satisfy 0 < min <= max, got {ratio}; e.g. use [0.75, 1.333].")
    if len(sigma) != 2 or not 0 < sigma[0] <= sigma[1]:
        raise ValueError(f"ViewGroup.blur_sigma must satisfy 0 < min <= max, got {sigma}; e.g. use [0.1, 2.0].")
    blur_kernel_size(group.size, group.blur_kernel, sigma[1])          # an unknown rule raises, naming it


def augment_group(canvas: torch.Tensor, source_hw: torch.Tensor, group: ViewGroup, generator: torch.Generator,
                  pixel_scale: float = 1.0, extent: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one group of views from canvases (B, H, W, 3), uint8 or float, whose pixels times `pixel_scale` lie in
    [0, 1]; `extent` as in `crop_resize_flip_one_by_one`.

    Returns views (B, n, 3, size, size) in [0, 1] (not normalised) and boxes (B, n, 4) float32 on canvas.device.
    """
    check_view_group(group)
    batch = canvas.shape[0]
    n, size, device = group.count, group.size, canvas.device
    view_count = batch * n

    # Every random draw happens here, in a fixed order, on the CPU generator.
    boxes = sample_crop_boxes(source_hw.repeat_interleave(n, dim=0), group.scale, group.ratio, generator)
    flip = torch.rand(view_count, generator=generator) < group.flip_p
    jitter = torch.rand(view_count, generator=generator) < group.jitter_p

    def jitter_factors(strength: float) -> torch.Tensor:
        drawn = _uniform(max(0.0, 1 - strength), 1 + strength, view_count, generator)
        return torch.where(jitter, drawn, torch.ones_like(drawn))
    brightness, contrast, saturation = (jitter_factors(group.brightness), jitter_factors(group.contrast),
                                        jitter_factors(group.saturation))
    hue = _uniform(-group.hue, group.hue, view_count, generator)
    hue = torch.where(jitter, hue, torch.zeros_like(hue))
    to_gray = torch.rand(view_count, generator=generator) < group.grayscale_p
    blur = torch.rand(view_count, generator=generator) < group.blur_p
    sigma = _uniform(group.blur_sigma[0], group.blur_sigma[1], view_count, generator)
    solarize = torch.rand(view_count, generator=generator) < group.solarize_p

    coloured = bool(jitter.any() or to_gray.any())
    if coloured:
        matrix, mean_coefficient, luma = colour_matrices(brightness, contrast, saturation, hue, to_gray)
    boxes_out = boxes.to(device=device, dtype=torch.float32).view(batch, n, 4)
    if device.type == "meta":      # the host's share of a GPU run (canvas_to_device): the device work left out
        return torch.empty(batch, n, 3, size, size, device=device), boxes_out

    # (K, 3, y, x) channel-first in [0, 1] from here on. The CPU's large views one by one, each coloured as it is
    # written; else (GPUs, the CPU's small views) two batched matmuls, whose channels-last views are coloured and
    # copied to channel-first.
    one_by_one = canvas.device.type == "cpu" and size >= PER_VIEW_MIN_SIZE
    if one_by_one:
        # One thread: each view's ops are too small to share (module docstring); the whole batch's ops below keep
        # the process's threads.
        with one_thread_on_cpu(canvas.device):
            views = crop_resize_flip_one_by_one(canvas, boxes, n, size, flip, pixel_scale, extent,
                                                group.interpolation,
                                                (matrix, mean_coefficient, luma) if coloured else None)
        if not coloured:
            views.clamp_(0, 1)
    else:
        views = crop_resize_flip_by_matmuls(canvas, boxes, n, size, flip, pixel_scale, extent,
                                            group.interpolation).permute(0, 3, 1, 2)         # from (K, y, x, 3)
        if coloured:
            views = colour_views(views, matrix, mean_coefficient, luma)
        views = views.clamp_(0, 1).contiguous()

    if blur.any():                             # the chosen views only, in place
        chosen = blur.nonzero().squeeze(1)
        kernel = blur_kernel_size(size, group.blur_kernel, group.blur_sigma[1])
        gaussian_blur_(views, chosen, sigma[chosen], kernel, opencv=one_by_one)

    if solarize.any():                         # in place, on the chosen views only
        chosen = solarize.nonzero().squeeze(1).to(device)
        solarized = views.index_select(0, chosen)
        views.index_copy_(0, chosen, torch.where(solarized >= 0.5, 1 - solarized, solarized))

    return views.view(batch, n, 3, size, size), boxes_out


def canvas_to_device(canvas: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Move uint8 canvases (B, S, S, 3) to `device`; uint8 travels 4x lighter than float.

    To a GPU the host's one job is a copy into page-locked memory, from which the GPU's copy engine reads while
    the host goes on (a copy from ordinary memory would hold the host until the GPU has it). Device "meta" is
    that GPU run's host side with the device work left out (`python -m pretrain.bench loader --sizes imagenet`
    measures it on CPUs): the same host copy, then every device operation is shape-only.
    """
    if canvas.dim() != 4 or canvas.shape[-1] != 3:
        raise ValueError(f"Expected uint8 canvases of shape (B, S, S, 3), got {tuple(canvas.shape)} {canvas.dtype}.")
    device = torch.device(device) if device is not None else canvas.device
    if device.type == "cuda":
        return canvas.pin_memory().to(device, non_blocking=True)
    if device.type == "meta":
        return canvas.clone().to(device)
    return canvas.to(device)


def normalise(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """(…, 3, H, W) images in [0, 1] -> (images - mean) / std per channel (in place when possible)."""
    if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
        raise ValueError(f"mean and std need 3 channel values with std > 0, got mean={tuple(mean)}, std={tuple(std)}.")
    mean_t = torch.tensor(mean, device=images.device, dtype=images.dtype).view(3, 1, 1)
    std_t = torch.tensor(std, device=images.device, dtype=images.dtype).view(3, 1, 1)
    return images.sub_(mean_t).div_(std_t)


def augment_views(canvas: torch.Tensor, source_hw: torch.Tensor, groups: list[ViewGroup],
                  mean: Sequence[float], std: Sequence[float],
                  generator: torch.Generator, extent: torch.Tensor | None = None
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Draw every view of every group from a batch of decoded canvases.

    canvas:    uint8 (B, H, W, 3) or (B, 3, H, W), or float in [0, 1] in either layout, on the device where
               the views should be made: each image stretched whole to the canvas, or (with `extent`) as
               decoded in its top-left corner.
    source_hw: (B, 2) source image heights and widths in pixels (for aspect ratios in source pixels).
    extent:    (B, 2) CPU heights and widths of the image in each canvas (a batch padded to its largest
               image: the loader's `canvas_size` 0); None when each image fills its canvas.
    groups:    the view recipe.
    mean, std: per-channel normalisation.
    generator: CPU torch.Generator driving every random choice.
    Returns (views, boxes): per group, normalised views (B, n, 3, size, size) and boxes (B, n, 4) as fractions
    of the source width / height, both on canvas.device.
    """
    if not groups:
        raise ValueError("augment_views needs at least one ViewGroup; pass e.g. [ViewGroup(count=2, size=32)].")
    if canvas.dim() != 4 or 3 not in (canvas.shape[1], canvas.shape[-1]):
        raise ValueError(f"Expected canvases (B, S, S, 3) or (B, 3, S, S), got shape {tuple(canvas.shape)}.")
    if canvas.shape[-1] != 3:
        canvas = canvas.permute(0, 2, 3, 1)          # to channels last, the layout the decoder writes
    if source_hw.shape != (canvas.shape[0], 2):
        raise ValueError(f"source_hw must be (B, 2) = ({canvas.shape[0]}, 2) heights/widths, got {tuple(source_hw.shape)}.")
    pixel_scale = 1 / 255 if canvas.dtype == torch.uint8 else 1.0      # rides on the resize
    all_views, all_boxes = [], []
    for group in groups:
        views, boxes = augment_group(canvas, source_hw, group, generator, pixel_scale, extent)
        all_views.append(normalise(views, mean, std))
        all_boxes.append(boxes)
    return all_views, all_boxes
