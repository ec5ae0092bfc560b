"""The Gaussian blur of the views (pretrain/data/augment.py, step 3): a kernel side from the view's size, as SimCLR's
rule, and the blur of a batch of views each with its own sigma, as a separable convolution with reflected borders
or, for the CPU's large views, OpenCV's separable filter with the same kernel and border."""
from __future__ import annotations

import cv2
import torch
import torch.nn.functional as F


def blur_kernel_size(view_size: int) -> int:
    """Gaussian blur kernel side for a view of `view_size` px: the odd number nearest 10% of the side, >= 3.

    SimCLR's rule (kernel = 10% of the image side); both loader backends use it so their blur matches.
    """
    return max(3, int(round(0.1 * view_size)) // 2 * 2 + 1)


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
