"""The view augmentation's operations against brute force, the views of the rewritten CPU path against those of
the code before it (commit f45537e) for the same seed, and the host-only ("meta") device of the loader benchmark."""
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageFilter

from pretrain.config import load_config, views_to_draw
from pretrain.data.augment import (augment_views, canvas_to_device, check_view_group, crop_resize_flip_by_matmuls,
                                   crop_resize_flip_one_by_one)
from pretrain.data.blur import blur_kernel_size, gaussian_blur, gaussian_blur_
from pretrain.data.loader import IMAGENET_MEAN, IMAGENET_STD
from pretrain.data.views import ViewGroup
from pretrain.runtime.memory_reuse import advise_huge_pages

ROOT = Path(__file__).parents[1]
# `augment_views(*reference_inputs(), torch.Generator().manual_seed(0))` with pretrain/data/augment.py of commit
# f45537e (before the CPU path wrote views into one preallocated channel-first batch), saved with torch.save.
REFERENCE = ROOT / "tests" / "data" / "augment_reference_f45537e.pt"


def reference_inputs():
    """Smooth uint8 canvases and a recipe that uses every operation: both resize paths (40 px one by one on the
    CPU, 12 px by matmuls), flips, jitter, grayscale, blur and solarisation."""
    generator = torch.Generator().manual_seed(3)
    noise = torch.rand(4, 3, 72, 72, generator=generator)
    canvas = (255 * F.avg_pool2d(noise, 5, 1, 2)).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()
    groups = [ViewGroup(count=2, size=40, grayscale_p=0.3, blur_p=0.7, solarize_p=0.5),
              ViewGroup(count=3, size=12, scale=(0.1, 0.4), blur_p=0.7, solarize_p=0.5)]
    return canvas, torch.tensor([[300, 400], [350, 350], [400, 300], [72, 72]]), groups, IMAGENET_MEAN, IMAGENET_STD


def test_views_equal_those_of_the_code_before_the_cpu_path_was_rewritten():
    """Same seed, same views: the rewrite changed where pixels are written, not their arithmetic (float32
    rounding of the channel-first colour matmul aside)."""
    expected = torch.load(REFERENCE)
    views, boxes = augment_views(*reference_inputs(), torch.Generator().manual_seed(0))
    for got, want in zip(views, expected["views"]):
        assert got.shape == want.shape and got.is_contiguous()
        assert (got - want).abs().max() < 1e-5
    assert torch.equal(views[1], expected["views"][1])         # the small views' matmuls: bit for bit
    for got, want in zip(boxes, expected["boxes"]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("path", ["convolution (GPUs)", "OpenCV in place (CPU)"])
def test_gaussian_blur_is_the_dense_2d_convolution_with_reflected_borders(path):
    """Brute force: every output pixel the sum of kernel(dy) * kernel(dx) * the reflected input pixel. The CPU
    blurs the chosen views in place with OpenCV; other devices use the grouped convolution."""
    images = torch.rand(2, 3, 9, 11, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.7, 1.6])
    radius = 2
    if path.startswith("convolution"):
        blurred = gaussian_blur(images, sigma, 2 * radius + 1)
    else:
        batch = torch.cat([torch.zeros(1, 3, 9, 11), images])            # view 0 is not chosen: left as it is
        gaussian_blur_(batch, torch.tensor([1, 2]), sigma, 2 * radius + 1)
        assert torch.equal(batch[0], torch.zeros(3, 9, 11))
        blurred = batch[1:]

    def reflect(i, n):
        return -i if i < 0 else 2 * (n - 1) - i if i >= n else i
    for view in range(2):
        weights = torch.exp(-0.5 * (torch.arange(-radius, radius + 1, dtype=torch.float64) / sigma[view]) ** 2)
        weights = weights / weights.sum()
        for y in range(9):
            for x in range(11):
                value = sum(weights[dy + radius] * weights[dx + radius]
                            * images[view, :, reflect(y + dy, 9), reflect(x + dx, 11)].double()
                            for dy in range(-radius, radius + 1) for dx in range(-radius, radius + 1))
                assert torch.allclose(blurred[view, :, y, x].double(), value, atol=1e-6)


def blur_difference(size: int, sigma: float, kernel: int, reference: str = "whole") -> tuple[float, float]:
    """(mean, max) |our blur with `kernel` - the reference| in grey levels over random uint8 pixels of a size x size
    view, away from the border. The reference: "whole", the same Gaussian out to 6 sigmas; "pil", PIL's
    GaussianBlur(radius=sigma) (which repeats the edge pixel where the project reflects it)."""
    pixels = np.random.default_rng(size).integers(0, 256, (size, size, 3), dtype=np.uint8)
    image = torch.from_numpy(pixels).permute(2, 0, 1)[None].double()
    ours = gaussian_blur(image, torch.tensor([sigma]), kernel)[0].permute(1, 2, 0).round().numpy()
    if reference == "pil":
        wanted = np.asarray(Image.fromarray(pixels).filter(ImageFilter.GaussianBlur(radius=sigma))).astype(np.float64)
    else:
        whole = min(2 * math.ceil(6 * sigma) + 1, 2 * size - 1)
        wanted = gaussian_blur(image, torch.tensor([sigma]), whole)[0].permute(1, 2, 0).numpy()
    inner = min(math.ceil(6 * sigma), (size - 4) // 2)
    difference = np.abs(ours - wanted)[inner:size - inner, inner:size - inner]
    return float(difference.mean()), float(difference.max())


# The presets whose references blur with PIL (DINO's and SimSiam's utils.GaussianBlur: ImageFilter.GaussianBlur with
# the drawn sigma as its radius); the SimCLR presets keep SimCLR's 10% kernel, the digits' theirs (docs/configuration.md)
PIL_BLUR_PRESETS = ["dino_fashion_mnist", "dino_resnet50_imagenet_folder", "dino_vit_small_imagenet_folder",
                    "simsiam_imagenet_folder"]


@pytest.mark.parametrize("preset", PIL_BLUR_PRESETS)
def test_the_presets_of_references_that_blur_with_pil_blur_with_the_whole_gaussian(preset):
    """Every blurred group of the preset, at its sigmas' ends and middle: within half a grey level on average, 2 at
    most, of the same Gaussian out to 6 sigmas, as PIL's blur, which has no kernel side, covers the whole of it.
    With SimCLR's 10% kernel (3 px at 16 px), dino_fashion_mnist's views at sigma 1 were 6.8 grey levels off on
    average."""
    groups = [group for group in views_to_draw(load_config(ROOT / f"configs/pretrain/{preset}.yaml")) if group.blur_p]
    assert groups
    for group in groups:
        low, high = group.blur_sigma
        kernel = blur_kernel_size(group.size, group.blur_kernel, high)
        assert kernel == min(2 * math.ceil(3 * high) + 1, 2 * group.size - 1)
        for sigma in (low, (low + high) / 2, high):
            mean, most = blur_difference(group.size, sigma, kernel)
            assert mean < 0.5 and most <= 2, (group.size, sigma, kernel, mean, most)
    assert blur_difference(16, 1.0, blur_kernel_size(16, "tenth"))[0] > 5       # the comparison bites


@pytest.mark.parametrize("size, sigma", [(16, 1.0), (96, 1.0), (96, 2.0), (224, 2.0)])
def test_the_whole_gaussian_is_pils_blur_where_pils_three_boxes_are_gaussian(size, sigma):
    """PIL approximates the Gaussian by three box blurs of its variance. At sigma 1 and 2 they agree with the
    project's kernel (3 sigmas) within 1 grey level on average, 3 at most; at sigmas 0.2-0.9 PIL's boxes are no
    Gaussian (4 to 10 levels from it on average): there the project blurs with the Gaussian the references name."""
    mean, most = blur_difference(size, sigma, blur_kernel_size(size, "sigma", sigma), reference="pil")
    assert mean < 1.0 and most <= 3


def test_an_unknown_blur_kernel_rule_is_refused_by_name():
    with pytest.raises(ValueError, match="blur_kernel='pil'"):
        check_view_group(ViewGroup(blur_p=0.5, blur_kernel="pil"))


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_each_large_view_is_its_own_antialiased_resize_of_the_rounded_crop(interpolation):
    """The one-by-one path writes view k into slot k of one channel-first float batch: exactly the uint8 resize
    of its rounded crop, mirrored when flipped, times the pixel scale."""
    canvas = reference_inputs()[0][:2]                                   # two images, two views each
    boxes = torch.tensor([[0.1, 0.2, 0.6, 0.9], [0.0, 0.0, 1.0, 1.0], [0.55, 0.05, 0.95, 0.45], [0.3, 0.3, 0.7, 0.8]],
                         dtype=torch.float64)
    flip = torch.tensor([False, True, True, False])
    views = crop_resize_flip_one_by_one(canvas, boxes, 2, 40, flip, 1 / 255, interpolation=interpolation)
    assert views.shape == (4, 3, 40, 40) and views.is_contiguous() and views.dtype == torch.float32
    for k, (x0, y0, x1, y1) in enumerate((boxes * 72).round().long().tolist()):
        crop = canvas[k // 2, y0:y1, x0:x1].permute(2, 0, 1)[None]
        resized = F.interpolate(crop, size=(40, 40), mode=interpolation, antialias=True, align_corners=False)[0]
        expected = (resized.flip(-1) if flip[k] else resized).float() * (1 / 255)
        assert torch.allclose(views[k], expected, atol=1e-7)


def test_the_large_views_are_drawn_in_one_thread_and_the_process_threads_are_given_back(monkeypatch):
    """The one-by-one loop runs with one intra-op thread (its small ops each woke OpenMP's team); the batch-wide
    operations around it, and the process after it, keep the threads they had. The views do not depend on it."""
    seen = []

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return crop_resize_flip_one_by_one(*args, **kwargs)

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        expected, _ = augment_views(*reference_inputs(), torch.Generator().manual_seed(0))
        monkeypatch.setattr("pretrain.data.augment.crop_resize_flip_one_by_one", recording)
        views, _ = augment_views(*reference_inputs(), torch.Generator().manual_seed(0))
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(got, want) for got, want in zip(views, expected))


def test_a_large_view_batch_is_advised_onto_huge_pages():
    """The kernel records the advice on the batch's memory (`hg` in /proc/self/smaps' VmFlags) where it has
    transparent huge pages; elsewhere the advice is refused and the tensor is returned all the same."""
    batch = torch.empty(16, 3, 224, 224)                                  # 9.6 MB: at least 3 whole 2 MB pages
    assert advise_huge_pages(batch) is batch
    if not Path("/sys/kernel/mm/transparent_hugepage").is_dir():
        return
    first_whole_page = -(-batch.data_ptr() // (2 << 20)) * (2 << 20)
    flags, inside = None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split()[0] and ":" not in line.split()[0]:
            low, high = (int(bound, 16) for bound in line.split()[0].split("-"))
            inside = low <= first_whole_page < high
        elif inside and line.startswith("VmFlags:"):
            flags = line.split()[1:]
    assert flags is not None and "hg" in flags, flags


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
@pytest.mark.parametrize("pixels", ["uint8", "float"])
def test_large_views_coloured_as_they_are_written_equal_the_batch_coloured_afterwards(interpolation, pixels):
    """The one-by-one path colours and clamps each view as it writes it (one batch, one pass): the same views as
    resizing the whole batch first, then the batched colour matmul (`colour_views`) and the clamp, with every
    jitter, grayscale and flip; strong factors, so that the clamp bites."""
    from pretrain.data.augment import colour_matrices, colour_views

    canvas = reference_inputs()[0][:2]
    if pixels == "float":
        canvas = canvas.float() / 255
    scale = 1 / 255 if pixels == "uint8" else 1.0
    boxes = torch.tensor([[0.1, 0.2, 0.6, 0.9], [0.0, 0.0, 1.0, 1.0], [0.55, 0.05, 0.95, 0.45], [0.3, 0.3, 0.7, 0.8]],
                         dtype=torch.float64)
    flip = torch.tensor([False, True, True, False])
    colour = colour_matrices(torch.tensor([1.0, 0.3, 1.0, 1.2]), torch.tensor([8.0, 1.0, 0.2, 1.0]),
                             torch.tensor([0.0, 1.7, 1.0, 1.3]), torch.tensor([0.2, -0.1, 0.0, 0.05]),
                             torch.tensor([False, False, True, False]))
    written = crop_resize_flip_one_by_one(canvas, boxes, 2, 40, flip, scale, interpolation=interpolation,
                                          colour=colour)
    afterwards = colour_views(crop_resize_flip_one_by_one(canvas, boxes, 2, 40, flip, scale,
                                                          interpolation=interpolation), *colour).clamp(0, 1)
    assert written.shape == (4, 3, 40, 40) and written.is_contiguous()
    assert (written - afterwards).abs().max() < 1e-5
    assert (written == 0).any() and (written == 1).any()                  # the clamp bit on both ends


def test_the_host_side_of_a_gpu_run_draws_the_same_boxes_and_computes_no_pixels():
    """Device "meta" (the loader benchmark's GPU host side): the canvas is copied as a pinned copy would be, every
    random draw happens as on a real device, the views are shape-only."""
    canvas, hw, groups, mean, std = reference_inputs()
    on_host = canvas_to_device(canvas, "meta")
    assert on_host.device.type == "meta" and on_host.shape == canvas.shape
    host_generator, cpu_generator = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    views, boxes = augment_views(on_host, hw, groups, mean, std, host_generator)
    cpu_views, cpu_boxes = augment_views(canvas, hw, groups, mean, std, cpu_generator)
    assert [v.shape for v in views] == [v.shape for v in cpu_views] and all(v.device.type == "meta" for v in views)
    assert [b.shape for b in boxes] == [b.shape for b in cpu_boxes] and all(b.device.type == "meta" for b in boxes)
    assert torch.equal(host_generator.get_state(), cpu_generator.get_state())      # the same draws, in order


def test_freed_memory_is_kept_for_reuse_only_when_asked():
    """mallopt is applied in a process of its own (it changes that process's malloc for good); the module is
    loaded from its file, without the package (which imports torch: 2 s a process)."""
    script = ("import importlib.util as u; spec = u.spec_from_file_location('m', 'pretrain/runtime/memory_reuse.py'); "
              "m = u.module_from_spec(spec); spec.loader.exec_module(m); print(m.reuse_freed_memory())")
    environment = {k: v for k, v in os.environ.items() if k != "HARDVIEW_MALLOC"}
    left = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT,
                          env=environment)
    applied = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT,
                             env={**environment, "HARDVIEW_MALLOC": "reuse"})
    assert applied.stdout.strip() == "True" and left.stdout.strip() == "False"


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_views_cut_from_padded_decoded_images_never_read_the_padding(interpolation):
    """`canvas_size` 0: each image sits in the top-left corner of a batch padded to the largest one. Whatever the
    padding holds, both resize paths (40 px one by one, 12 px by matmuls) draw the same views; a whole-image
    view without jitter is the image itself resized."""
    canvas, _, groups, mean, std = reference_inputs()
    groups = [replace(group, interpolation=interpolation) for group in groups]
    extent = torch.tensor([[72, 72], [50, 64], [64, 30], [33, 41]])       # the images' own heights and widths
    views = {}
    for fill in (0, 255):
        padded = canvas.clone()
        for k, (height, width) in enumerate(extent.tolist()):
            padded[k, height:], padded[k, :, width:] = fill, fill
        views[fill], _ = augment_views(padded, extent, groups, mean, std, torch.Generator().manual_seed(0), extent)
    assert all(torch.equal(a, b) for a, b in zip(views[0], views[255]))
    whole = ViewGroup(count=1, size=40, scale=(1.0, 1.0), ratio=(0.1, 10.0), flip_p=0.0, jitter_p=0.0, grayscale_p=0.0,
                      interpolation=interpolation)
    drawn, _ = augment_views(canvas, extent, [whole], (0.0,) * 3, (1.0,) * 3, torch.Generator().manual_seed(0), extent)
    height, width = extent[1].tolist()
    image = canvas[1:2, :height, :width].permute(0, 3, 1, 2)
    expected = F.interpolate(image, size=(40, 40), mode=interpolation, antialias=True, align_corners=False) / 255
    assert torch.allclose(drawn[0][1, 0], expected[0], atol=1e-6)


def keys_cubic(distance: float) -> float:
    """Keys (1981) cubic convolution with a = -0.5, PIL's bicubic filter, written out on its own."""
    d, a = abs(distance), -0.5
    if d <= 1:
        return (a + 2) * d ** 3 - (a + 3) * d ** 2 + 1
    return a * d ** 3 - 5 * a * d ** 2 + 8 * a * d - 4 * a if d < 2 else 0.0


def test_bicubic_views_are_the_brute_force_antialiased_cubic_resize_of_their_crop():
    """The matmuls' bicubic view (GPUs; the CPU's views under 32 px), pixel by pixel: the crop's output pixel centres
    on the canvas, Keys' cubic at the distance to every canvas pixel centre divided by the downscale factor (at least
    1), normalised, clamped to [0, 1]; a whole-image view equals torch's antialiased bicubic resize."""
    canvas = torch.rand(1, 18, 21, 3, generator=torch.Generator().manual_seed(5))     # one image, three views
    boxes = torch.tensor([[0.1, 0.2, 0.7, 0.9], [0.3, 0.0, 0.5, 0.4], [0.0, 0.0, 1.0, 1.0]], dtype=torch.float64)
    views_per_image, size = 3, 7
    flip = torch.tensor([False, True, False])
    views = crop_resize_flip_by_matmuls(canvas, boxes, views_per_image, size, flip, interpolation="bicubic")
    for k, (x0, y0, x1, y1) in enumerate(boxes.tolist()):
        def weights(start, length, source):
            step = length / size
            rows = []
            for i in range(size):
                centre = start + (i + 0.5) * step
                row = [keys_cubic((j + 0.5 - centre) / max(step, 1.0)) for j in range(source)]
                rows.append([w / sum(row) for w in row])
            return torch.tensor(rows, dtype=torch.float64)
        rows, cols = weights(y0 * 18, (y1 - y0) * 18, 18), weights(x0 * 21, (x1 - x0) * 21, 21)
        expected = torch.einsum("yh,hwc,xw->yxc", rows, canvas[0].double(), cols).clamp(0, 1)
        if flip[k]:
            expected = expected.flip(1)
        assert torch.allclose(views[k].double(), expected, atol=1e-5)
    whole = F.interpolate(canvas.permute(0, 3, 1, 2), size=(size, size), mode="bicubic", antialias=True,
                          align_corners=False).clamp(0, 1)
    assert torch.allclose(views[2].permute(2, 0, 1), whole[0], atol=1e-5)
    bilinear = crop_resize_flip_by_matmuls(canvas, boxes, views_per_image, size, flip)
    assert not torch.allclose(bilinear, views, atol=1e-3)
    with pytest.raises(ValueError, match=r"interpolation='nearest' is not one of \('bilinear', 'bicubic'\)"):
        check_view_group(ViewGroup(interpolation="nearest"))


def test_the_torchvision_loader_resizes_with_the_groups_interpolation(tmp_path):
    """The torchvision backend's crops take ViewGroup.interpolation too: a whole-image view without jitter is the
    image resized with that filter (the classic pipeline of PIL images, as DataAugmentationDINO)."""
    from PIL import Image
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    from pretrain.data.torchvision_loader import ImageFolderViews

    (tmp_path / "class").mkdir()
    pixels = (255 * torch.rand(30, 40, 3, generator=torch.Generator().manual_seed(2))).to(torch.uint8).numpy()
    Image.fromarray(pixels).save(tmp_path / "class" / "image.png")
    drawn = {}
    for interpolation in ("bilinear", "bicubic"):
        whole = ViewGroup(count=1, size=12, scale=(1.0, 1.0), ratio=(4 / 3, 4 / 3), flip_p=0.0, jitter_p=0.0,
                          grayscale_p=0.0, interpolation=interpolation)
        views, _, _, _ = ImageFolderViews(tmp_path, [whole], (0.0,) * 3, (1.0,) * 3)[0]
        expected = TF.to_tensor(TF.resize(Image.fromarray(pixels), [12, 12], InterpolationMode(interpolation),
                                          antialias=True))
        assert torch.allclose(views[0][0], expected, atol=1e-6)
        drawn[interpolation] = views[0][0]
    assert not torch.allclose(drawn["bilinear"], drawn["bicubic"], atol=1e-3)
