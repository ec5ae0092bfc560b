"""The images the benchmarks read: generated 64 px JPEGs (digits on colour gradients), generated ~400 x 350 px
photo-like JPEGs, and ImageNet-sized JPEGs cut from real photographs (`photograph_folder`)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

SIMCLR_SIDE = 32
SOURCE_SIDE = 64


def synthetic_image_folder(root: Path, count: int, side: int = SOURCE_SIDE) -> Path:
    """`count` real-looking side x side JPEGs in 10 class folders: the digits upsampled, tinted, on a colour
    gradient (so colour jitter and crops act on real structure). Reused when already complete."""
    # heavy: cv2, for this benchmark only (see pretrain/bench/__init__.py)
    from pretrain.data.digits import digits_images

    marker = root / f".complete-{count}-{side}"
    if marker.exists():
        return root
    images, labels = digits_images(side)
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 1, side, dtype=np.float32)
    for i in range(count):
        digit = images[i % len(images)].astype(np.float32) / 255
        ink, paper_a, paper_b = rng.uniform(0, 1, (3, 3)).astype(np.float32)
        paper = paper_a[None, None] * ramp[:, None, None] + paper_b[None, None] * (1 - ramp[None, :, None])
        picture = digit * ink[None, None] + (1 - digit) * paper
        folder = root / f"class{labels[i % len(images)]}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((picture * 255).astype(np.uint8)).save(folder / f"{i:06d}.jpg", quality=90)
    marker.touch()
    return root


def synthetic_photo_folder(root: Path, count: int) -> Path:
    """`count` photo-sized JPEGs (about 400 x 350 px, landscape and portrait, quality 90) in 10 class folders:
    a large digit in a random colour over a colour gradient, band-limited texture and sensor-like noise, so
    that a JPEG costs about what a photo of that size costs to decode (tens of KB, not a few). Reused when
    already complete."""
    # heavy: cv2, for this benchmark only (see pretrain/bench/__init__.py)
    from pretrain.data.digits import digits_images

    marker = root / f".complete-{count}"
    if marker.exists():
        return root
    digits, labels = digits_images(64)
    rng = np.random.default_rng(0)
    for i in range(count):
        width, height = int(rng.integers(360, 460)), int(rng.integers(300, 400))
        if rng.random() < 0.25:
            width, height = height, width
        y, x = np.mgrid[0:height, 0:width].astype(np.float32)
        a, b = rng.uniform(0, 1, (2, 3)).astype(np.float32)
        picture = a * (x / width)[..., None] + b * (y / height)[..., None]
        for _ in range(4):                                   # band-limited texture
            fx, fy, phase = rng.uniform(0.01, 0.15), rng.uniform(0.01, 0.15), rng.uniform(0, 6.3)
            picture += 0.08 * np.sin(fx * x + fy * y + phase)[..., None] * rng.uniform(-1, 1, 3).astype(np.float32)
        side = int(rng.integers(min(width, height) // 3, min(width, height)))
        digit = np.asarray(Image.fromarray(digits[i % len(digits)]).resize((side, side)), dtype=np.float32) / 255
        top, left = int(rng.integers(0, height - side + 1)), int(rng.integers(0, width - side + 1))
        ink = rng.uniform(0, 1, 3).astype(np.float32)
        region = picture[top:top + side, left:left + side]
        picture[top:top + side, left:left + side] = digit * ink + (1 - digit) * region
        picture += rng.normal(0, 0.03, picture.shape).astype(np.float32)
        folder = root / f"class{labels[i % len(digits)]}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((picture.clip(0, 1) * 255).astype(np.uint8)).save(folder / f"{i:06d}.jpg", quality=90)
    marker.touch()
    return root


PHOTO_SOURCE = Path("/usr/share/backgrounds/mate/nature")    # Debian's mate-backgrounds: 12 photographs, 1280-2560 px
PHOTO_SIZES = {"400x350": ((360, 460), (300, 400)), "1000x750": ((900, 1100), (680, 820))}   # width, height ranges


def photograph_folder(root: Path, count: int, source: Path, size: str) -> Path:
    """`count` JPEGs (quality 90) cut from the real photographs in `source`: per image, a random region of a
    random photograph (10-100% of its area, the aspect of the output), resized to about `size` (PHOTO_SIZES;
    a quarter of them portrait), in 10 class folders. The photographs install offline with Debian's
    `mate-backgrounds` package (PHOTO_SOURCE). Reused when already complete."""
    photographs = sorted(p for p in source.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
    if not photographs:
        raise SystemExit(f"error: --photos {source} holds no .jpg/.png photographs; install them with "
                         "`apt-get install mate-backgrounds`, pass another folder, or `--photos generated`")
    marker = root / f".complete-{count}"
    if marker.exists():
        return root
    sources = [Image.open(p).convert("RGB") for p in photographs]
    rng = np.random.default_rng(0)
    (low_w, high_w), (low_h, high_h) = PHOTO_SIZES[size]
    for i in range(count):
        width, height = int(rng.integers(low_w, high_w)), int(rng.integers(low_h, high_h))
        if rng.random() < 0.25:
            width, height = height, width
        photo = sources[i % len(sources)]
        area = rng.uniform(0.1, 1.0) * photo.width * photo.height
        crop_w = min(photo.width, int((area * width / height) ** 0.5))
        crop_h = min(photo.height, int(crop_w * height / width))
        left, top = int(rng.integers(0, photo.width - crop_w + 1)), int(rng.integers(0, photo.height - crop_h + 1))
        picture = photo.resize((width, height), Image.BICUBIC, box=(left, top, left + crop_w, top + crop_h))
        folder = root / f"class{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        picture.save(folder / f"{i:06d}.jpg", quality=90)
    marker.touch()
    return root


def benchmark_folder(work_dir: Path, count: int, photos: str, size: str) -> tuple[Path, str]:
    """(image folder, description) of the ImageNet-sized images: real photographs from `photos` (a folder) when it
    holds any, else (or with `photos` = "generated") the generated ~400 x 350 px set."""
    if photos != "generated" and Path(photos).is_dir():
        folder = photograph_folder(work_dir / f"photographs-{size}-{count}", count, Path(photos), size)
        return folder, f"{count} JPEGs ~{size.replace('x', ' x ')} px q90 cut from the photographs in {photos}"
    if photos != "generated":
        print(f"note: {photos} does not exist (`apt-get install mate-backgrounds` installs the photographs): "
              "measuring on the generated images instead", flush=True)
    return synthetic_photo_folder(work_dir / f"photos-{count}", count), f"{count} generated JPEGs ~400 x 350 px q90"


def benchmark_images(work_dir: Path, count: int, photos: str, size: str, workers: int) -> tuple[Path, Path, str]:
    """(image folder, .beton, description): `benchmark_folder`'s images and the .beton of them at their own size."""
    # heavy: cv2, for this benchmark only (see pretrain/bench/__init__.py)
    from pretrain.data.writer import write_image_folder

    folder, described = benchmark_folder(work_dir, count, photos, size)
    beton = folder.with_suffix(".beton")
    if not beton.exists():          # stored at their own size (the writer's default would cap the longer side at 512)
        write_image_folder(folder, beton, workers=workers, max_side=None)
    return folder, beton, described
