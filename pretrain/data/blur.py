"""The Gaussian blur of the views (pretrain/data/augment.py, step 3): a kernel side by one of the references' rules,
and the blur of a batch of views each with its own sigma, as a separable convolution with reflected borders or, for
the CPU's large views, OpenCV's separable filter with the same kernel and border."""
from __future__ import annotations

import math

import cv2
import torch
import torch.nn.functional as F

# ViewGroup.blur_kernel: how the kernel's side is chosen (blur_kernel_size)
BLUR_KERNELS = ("tenth", "sigma")


def blur_kernel_size(view_size: int, rule: str = "tenth", max_sigma: float = 2.0) -> int:
    """Gaussian blur kernel side for a view of `view_size` px whose sigmas reach `max_sigma`, by `rule`:

    - "tenth": the odd number nearest 10% of the side, >= 3: SimCLR's rule (google-research/simclr `data_util.py`,
      `kernel_size=image_size // 10`; the HVS authors' SimCLR branch too). It truncates a wide Gaussian on a small
      view: 3 px at 16 px, where sigma reaches 1.
    - "sigma": 2 x ceil(3 x max_sigma) + 1, out to three sigmas: the whole Gaussian, as PIL's
      `ImageFilter.GaussianBlur(radius=sigma)`, which has no kernel side, blurs (DINO's and SimSiam's `GaussianBlur`,
      and lightly's). Within half a grey level on average of the Gaussian out to 6 sigmas; "tenth" is 6.8 levels off
      at 16 px and sigma 1. PIL itself approximates the Gaussian by three box blurs of its variance: at sigmas 1 and
      2 within 1 grey level of this blur, at 0.2-0.9 4 to 10 levels off the Gaussian on random pixels; the project
      blurs with the Gaussian there (tests/test_augment.py).

    Never wider than the reflected border allows (2 x view_size - 1). Both loader backends use it, so their blur
    matches.
    """
    if rule == "tenth":
        side = max(3, int(round(0.1 * view_size)) // 2 * 2 + 1)
    elif rule == "sigma":
        side = 2 * math.ceil(3 * max_sigma) + 1
    else:
        raise ValueError(f"ViewGroup.blur_kernel={rule!r} is not one of {BLUR_KERNELS}: 'tenth' (SimCLR's 10% of the "
                         "view) or 'sigma' (three sigmas, PIL's blur: DINO, SimSiam).")
    return min(side, 2 * view_size - 1)


def gaussian_kernels(sigma: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """(K, kernel_size) float64 CPU 1-D Gaussian kernels, one per sigma (K,), each summing to 1."""
    radius = kernel_size // 2
    offsets = torch.arange(-radius, radius + 1, dtype=torch.float64)
    kernel = torch.exp(-0.5 * (offsets[None, :] / sigma.to(torch.float64)[:, None]) ** 2)
    return kernel / kernel.sum(dim=1, keepdim=True)


def gaussian_blur(images: torch.Tensor, sigma: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """Blur every (3, H, W) image of `images` with its own sigma (K,), separable kernel, reflect padding."""
    count, channels, height, width = images.shape
    radius = kernel_size // 2
    kernel = gaussian_kernels(sigma, kernel_size).to(images.device, images.dtype)
    kernel = kernel.repeat_interleave(channels, dim=0)            # (K * 3, kernel_size)
    flat = images.reshape(1, count * channels, height, width)
    flat = F.pad(flat, (radius, radius, radius, radius), mode="reflect")
    flat = F.conv2d(flat, kernel.view(-1, 1, 1, kernel_size), groups=count * channels)
    flat = F.conv2d(flat, kernel.view(-1, 1, kernel_size, 1), groups=count * channels)
    return flat.view(count, channels, height, width)


def gaussian_blur_(views: torch.Tensor, chosen: torch.Tensor, sigma: torch.Tensor, kernel_size: int,
                   opencv: bool = True) -> None:
    """Blur views[chosen] (K, 3, H, W), contiguous, in place, view chosen[i] with sigma[i]: `gaussian_blur`.

    On the CPU (with `opencv`) each plane goes through OpenCV's separable filter with the same kernel and border
    (reflect without repeating the edge, BORDER_REFLECT_101): 5x less CPU time than PyTorch's grouped
    convolution (oneDNN's depthwise kernel for 1-D filters), the same values to float32 rounding. Elsewhere, and
    for the CPU's small views (whose results, the digits runs', were measured with it): the convolution.
    """
    if views.device.type != "cpu" or not opencv:
        on_device = chosen.to(views.device)
        views.index_copy_(0, on_device, gaussian_blur(views.index_select(0, on_device), sigma, kernel_size))
        return
    planes = views.numpy()
    for view, kernel in zip(chosen.tolist(), gaussian_kernels(sigma, kernel_size).float().numpy()):
        for plane in planes[view]:
            cv2.sepFilter2D(plane, -1, kernel, kernel, dst=plane, borderType=cv2.BORDER_REFLECT_101)
