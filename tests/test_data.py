"""The N-view loaders (FFCV and torchvision), batched augmentation, evaluation loader and pair_iou."""
from __future__ import annotations
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from pretrain.data.augment import augment_views, sample_crop_boxes
from pretrain.data.loader import build_image_loader, build_view_loader
from pretrain.data.views import ViewGroup, pair_iou
from pretrain.data.writer import list_image_folder, write_image_folder
from pretrain.runtime.batch_prefetch import prepared_one_ahead, tensors_in

from tests.machine_speed import scaled

GROUPS = [ViewGroup(count=2, size=24, scale=(0.3, 0.9), ratio=(0.5, 2.0)),
          ViewGroup(count=3, size=12, scale=(0.1, 0.4), blur_p=0.5, solarize_p=0.5)]
IMAGE_SHAPES = [(24, 48), (48, 24), (32, 32), (20, 60)]          # (height, width): aspect matters for boxes


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """44 JPEGs of 4 shapes in 3 classes, as an image folder and the .beton written from it."""
    root = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    for i in range(44):
        height, width = IMAGE_SHAPES[i % 4]
        folder = root / "images" / f"class{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        image = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
        Image.fromarray(image).save(folder / f"{i:03d}.jpg", quality=95)
    beton = root / "train.beton"
    write_image_folder(root / "images", beton, workers=1)
    paths, labels, _ = list_image_folder(root / "images")
    hw = np.array([Image.open(p).size[::-1] for p in paths])
    return {"folder": root / "images", "beton": beton, "labels": np.array(labels), "hw": hw}


@pytest.fixture(scope="module")
def ffcv_loader(dataset):
    return build_view_loader(dataset["beton"], GROUPS, 8, canvas_size=32, num_workers=1, seed=3)


def check_batch(batch, dataset, batch_size):
    assert [tuple(v.shape) for v in batch.views] == [(batch_size, g.count, 3, g.size, g.size) for g in GROUPS]
    assert [tuple(b.shape) for b in batch.boxes] == [(batch_size, g.count, 4) for g in GROUPS]
    assert all(torch.isfinite(v).all() for v in batch.views)
    indices = batch.indices.numpy()
    assert (batch.labels.numpy() == dataset["labels"][indices]).all()
    hw = torch.tensor(dataset["hw"][indices], dtype=torch.float64)
    for group, boxes in zip(GROUPS, batch.boxes):
        boxes = boxes.double()
        x0, y0, x1, y1 = boxes.unbind(-1)
        assert (x0 >= 0).all() and (y0 >= 0).all() and (x1 <= 1 + 1e-6).all() and (y1 <= 1 + 1e-6).all()
        assert (x1 > x0).all() and (y1 > y0).all()
        area = (x1 - x0) * (y1 - y0)
        aspect = (x1 - x0) * hw[:, None, 1] / ((y1 - y0) * hw[:, None, 0])     # in source pixels
        # the torchvision-style fallback (after 10 misses) may leave the ranges; it is rare here
        in_range = ((area >= group.scale[0] - 0.02) & (area <= group.scale[1] + 0.02)
                    & (aspect >= group.ratio[0] * 0.9) & (aspect <= group.ratio[1] * 1.1))
        assert in_range.float().mean() > 0.9


@pytest.mark.parametrize("batches_taken", [1, 2])
def test_stopping_an_ffcv_epoch_early_ends_its_decode_thread(ffcv_loader, batches_taken):
    """A run that stops mid-epoch (engine.max_steps) must not leave FFCV's decode thread running while the
    interpreter exits: that aborted a CI run ("terminate called without an active exception").
    5 batches, FFCV's queue holds 3: after 1 the thread is still decoding, after 2 it ends in a put(None)
    that has no timeout. Closing the epoch must end the thread in both cases, and not hang."""
    from ffcv.loader.epoch_iterator import EpochIterator

    epoch = ffcv_loader.epoch(0)
    for _ in range(batches_taken):
        next(epoch)
    closer = threading.Thread(target=epoch.close)
    closer.start()
    closer.join(timeout=scaled(60))
    assert not closer.is_alive(), "closing an FFCV epoch early hung"
    assert [t for t in threading.enumerate() if isinstance(t, EpochIterator)] == []


def test_off_cuda_the_loop_reads_the_loaders_own_batches(ffcv_loader):
    """The loop's next-batch preparation on a side CUDA stream (pretrain/runtime/batch_prefetch.py) hands a CPU's (or
    meta's) epoch through untouched, the same generator: a CPU run's batches, resume and timing are those of before.
    On CUDA it marks every tensor of a batch for the step's stream: the walk finds each of a ViewBatch's, once.
    (Its CUDA half: tests/gpu, the same batches as without it.)"""
    epoch = ffcv_loader.epoch(0)
    assert prepared_one_ahead(epoch, torch.device("cpu")) is epoch
    assert prepared_one_ahead(epoch, torch.device("meta")) is epoch
    batch = next(epoch)
    epoch.close()
    found = [id(tensor) for tensor in tensors_in(batch)]
    assert sorted(found) == sorted(id(t) for t in [*batch.views, *batch.boxes, batch.labels, batch.indices])
    assert len(found) == 2 + 2 + 2                           # GROUPS: two groups of views and boxes


def test_ffcv_loader_yields_n_views_with_valid_boxes_and_matching_labels(ffcv_loader, dataset):
    assert ffcv_loader.num_images == 44 and len(ffcv_loader) == 5
    batches = list(ffcv_loader.epoch(0))
    assert len(batches) == 5
    for batch in batches:
        check_batch(batch, dataset, 8)
    seen = torch.cat([b.indices for b in batches])
    assert seen.unique().numel() == 40                      # a permutation, last partial batch dropped


def test_start_batch_continues_the_epoch_and_reruns_reproduce(ffcv_loader):
    full = [b.indices for b in ffcv_loader.epoch(2)]
    tail = [b.indices for b in ffcv_loader.epoch(2, start_batch=3)]
    assert len(tail) == 2 and all(torch.equal(a, b) for a, b in zip(full[3:], tail))
    first, again = next(ffcv_loader.epoch(1)), next(ffcv_loader.epoch(1))
    assert torch.equal(first.views[0], again.views[0]) and torch.equal(first.boxes[1], again.boxes[1])
    other_epoch = next(ffcv_loader.epoch(4))
    assert not torch.equal(first.indices, other_epoch.indices)


def test_ranks_get_disjoint_equal_shards(dataset):
    shards = []
    for rank in range(3):
        loader = build_view_loader(dataset["beton"], GROUPS[:1], 4, canvas_size=16, num_workers=1, rank=rank,
                                   world_size=3)
        assert len(loader) == 3                              # 44 // 3 = 14 per rank -> 3 batches of 4
        shards.append(np.concatenate([loader.epoch_indices(5)]))
        assert (torch.cat([b.indices for b in loader.epoch(5)]).numpy() == shards[-1]).all()
    assert {len(s) for s in shards} == {12}
    assert len(set(np.concatenate(shards).tolist())) == 36   # disjoint


def test_each_image_is_decoded_once_however_many_views(dataset, monkeypatch):
    """Counts the JPEG decodes the FFCV pipeline makes (numba off so that Python counters run inside it)."""
    from ffcv.pipeline.compiler import Compiler

    from pretrain.data import ffcv_loader as ffcv_module

    decoded = []
    real_imdecode = ffcv_module.DECODE_STEPS["imdecode"]

    def counting_imdecode(source, destination, *args):
        decoded.append(1)
        return real_imdecode(source, destination, *args)

    monkeypatch.setitem(ffcv_module.DECODE_STEPS, "imdecode", counting_imdecode)
    Compiler.set_enabled(False)
    try:
        loader = build_view_loader(dataset["beton"], GROUPS, 8, canvas_size=32, num_workers=1)
        batches = list(loader.epoch(0))
    finally:
        Compiler.set_enabled(True)
    views_drawn = sum(v.shape[0] * v.shape[1] for b in batches for v in b.views)
    assert len(batches) == 5 and views_drawn == 40 * 5
    # FFCV prefetches at most the batches of this epoch, so decodes == samples (not views, not 2x samples)
    assert len(decoded) == 40


def test_ffcvs_integer_decoders_crop_box_and_page_reader_come_from_numbas_cache_and_decode_the_same(dataset,
                                                                                                   monkeypatch):
    """pretrain/data/numba_cache.py: FFCV compiles each loader's functions anew; the integer decoders, the centre
    crop's box and the page reader are compiled once into numba's cache folder and every later compilation of them,
    in this process or another, loads them from there, decoding the same. Nothing else FFCV compiles is cached (the
    image decoders and FFCV's C calls hold this process's addresses)."""
    from pretrain.data import ffcv_loader

    compiled = []
    compile_with_cache = ffcv_loader.Compiler.compile.__func__

    def recording(cls, code, signature=None):                # FFCV's compiler wrapped once more, to see them
        compiled.append(compile_with_cache(cls, code, signature))
        return compiled[-1]

    monkeypatch.setattr(ffcv_loader.Compiler, "compile", classmethod(recording))

    def decoded(loader):                  # every field of every batch (FFCV reuses its batch memory: copied)
        batches = ffcv_loader.ffcv_batches(loader, np.arange(44))
        return [torch.cat(field) for field in zip(*([f.clone() for f in batch] for batch in batches))]

    _, labels, indices, heights, widths = decoded(ffcv_loader.build_ffcv_loader(dataset["beton"], 0, 8, 1, False))
    crops = [decoded(ffcv_loader.build_ffcv_centre_crop_loader(dataset["beton"], 16, 0.875, 8, 1))[0]
             for _ in range(2)]
    cached = [d for d in compiled if d.stats.cache_path]
    assert sorted({d.py_func.__qualname__ for d in cached}) == ["BasicDecoder.generate_code.<locals>.decoder",
                                                                "OSCacheManager.compile_reader.<locals>.read",
                                                                "get_center_crop"]
    assert len(compiled) > len(cached)                  # the image decoders and FFCV's C calls, not cached
    hits = sum(sum(d.stats.cache_hits.values()) for d in cached)
    misses = sum(sum(d.stats.cache_misses.values()) for d in cached)
    # 4 + 2 + 2 integer fields, 2 crop boxes and 3 readers (one a loader) run: each kind compiled at most once (by the
    # first loader that needs it, in this process or an earlier one), every later one loaded from the folder
    assert hits + misses == 13 and misses <= 3
    assert (labels.numpy() == dataset["labels"]).all() and torch.equal(indices, torch.arange(44))
    assert (torch.stack([heights, widths], 1).numpy() == dataset["hw"]).all()
    assert torch.equal(*crops)                          # the same crops, whichever box decoder was compiled or loaded


def test_the_loader_on_the_meta_device_is_the_host_side_of_a_gpu_run(dataset, ffcv_loader):
    """`python -m pretrain.bench loader --sizes imagenet` times the host's share of a GPU run with the same loader on
    device "meta": the same batches, every tensor shape-only (a meta tensor holds no values)."""
    host_only = build_view_loader(dataset["beton"], GROUPS, 8, canvas_size=32, num_workers=1, seed=3, device="meta")
    assert np.array_equal(host_only.epoch_indices(1), ffcv_loader.epoch_indices(1))
    on_meta, on_cpu = list(host_only.epoch(1)), list(ffcv_loader.epoch(1))
    assert len(on_meta) == len(on_cpu) == 5
    for meta_batch, cpu_batch in zip(on_meta, on_cpu):
        assert [v.shape for v in meta_batch.views] == [v.shape for v in cpu_batch.views]
        assert [b.shape for b in meta_batch.boxes] == [b.shape for b in cpu_batch.boxes]
        assert all(t.device.type == "meta" for t in [*meta_batch.views, *meta_batch.boxes, meta_batch.labels])


def test_canvas_size_0_hands_the_decoded_images_themselves_to_the_views(tmp_path, dataset):
    """A raw (lossless) .beton: with `canvas_size` 0 the decoder's batch holds every image's own pixels, unresized,
    in the top-left corner of a batch padded to the largest stored height and width; the loader draws views."""
    from pretrain.data.ffcv_loader import build_ffcv_loader, ffcv_batches

    beton = tmp_path / "raw.beton"
    write_image_folder(dataset["folder"], beton, write_mode="raw", workers=1)
    paths, _, _ = list_image_folder(dataset["folder"])
    loader = build_ffcv_loader(beton, 0, 8, 1, drop_last=False)
    canvas, _, indices, heights, widths = next(iter(ffcv_batches(loader, np.arange(8))))
    assert canvas.shape == (8, max(h for h, _ in IMAGE_SHAPES), max(w for _, w in IMAGE_SHAPES), 3)
    for k, index in enumerate(indices.tolist()):
        source = np.asarray(Image.open(paths[index]).convert("RGB"))
        assert (heights[k], widths[k]) == source.shape[:2]
        assert np.array_equal(canvas[k, :heights[k], :widths[k]].numpy(), source)
    views = next(iter(build_view_loader(beton, GROUPS, 8, canvas_size=0, num_workers=1).epoch(0)))
    check_batch(views, dataset, 8)


def test_torchvision_backend_has_the_same_shapes_and_semantics(dataset):
    loader = build_view_loader(dataset["folder"], GROUPS, 8, backend="torchvision", num_workers=1, seed=3)
    ffcv = build_view_loader(dataset["beton"], GROUPS, 8, canvas_size=32, num_workers=1, seed=3)
    assert loader.num_images == 44 and len(loader) == len(ffcv)
    batches = list(loader.epoch(0))
    for batch in batches:
        check_batch(batch, dataset, 8)
    assert torch.equal(torch.cat([b.indices for b in batches]), torch.as_tensor(ffcv.epoch_indices(0)))
    tail = [b.indices for b in loader.epoch(0, start_batch=4)]
    assert len(tail) == 1 and torch.equal(tail[0], batches[4].indices)


def centre_crop_reference(path, size: int, crop_fraction: float) -> torch.Tensor:
    """The evaluation crop by the book, with PIL: shorter side to size / crop_fraction, centre size x size."""
    from torchvision.transforms import functional as TF

    image = TF.center_crop(TF.resize(Image.open(path).convert("RGB"), round(size / crop_fraction)), size)
    return (torch.tensor(np.asarray(image)).permute(2, 0, 1).float() / 255 - 0.5) / 0.25


def nearest(images: torch.Tensor, references: torch.Tensor) -> list[int]:
    """For every image, the index of the reference it differs least from (mean absolute difference)."""
    return (images[:, None] - references[None]).abs().mean(dim=(2, 3, 4)).argmin(dim=1).tolist()


def test_image_loader_reads_every_image_in_order(dataset):
    loader = build_image_loader(dataset["beton"], 16, 10, mean=(0.5,) * 3, std=(0.25,) * 3, num_workers=1)
    batches = list(loader)
    assert len(batches) == len(loader) == 5
    images = torch.cat([b[0] for b in batches])
    assert images.shape == (44, 3, 16, 16)
    assert torch.equal(torch.cat([b[2] for b in batches]), torch.arange(44))
    assert (torch.cat([b[1] for b in batches]).numpy() == dataset["labels"]).all()
    paths = sorted(dataset["folder"].rglob("*.jpg"), key=lambda p: (p.parent.name, p.name))
    reference = torch.stack([centre_crop_reference(path, 16, 0.875) for path in paths])
    assert (images - reference).abs().mean() < 0.3               # the same crops (JPEG + resize filters differ)
    assert nearest(images, reference) == list(range(44))        # each image is closest to its own reference


def test_image_loader_reads_an_image_folder_without_ffcv_like_the_beton(dataset):
    folder = build_image_loader(dataset["folder"], 16, 10, mean=(0.5,) * 3, std=(0.25,) * 3, num_workers=0)
    beton = build_image_loader(dataset["beton"], 16, 10, mean=(0.5,) * 3, std=(0.25,) * 3, num_workers=1)
    from_folder, from_beton = list(folder), list(beton)
    assert len(from_folder) == len(folder) == 5
    assert torch.equal(torch.cat([b[2] for b in from_folder]), torch.arange(44))
    assert (torch.cat([b[1] for b in from_folder]).numpy() == dataset["labels"]).all()
    images_folder = torch.cat([b[0] for b in from_folder])
    images_beton = torch.cat([b[0].clone() for b in from_beton])
    assert images_folder.shape == images_beton.shape == (44, 3, 16, 16)
    # The same pictures (the .beton holds re-encoded JPEGs; FFCV resizes with OpenCV, torchvision with PIL).
    assert (images_folder - images_beton).abs().mean() < 0.3
    assert nearest(images_folder, images_beton) == list(range(44))


@pytest.mark.parametrize("crop_fraction", [1.0, 0.875])
def test_evaluation_images_are_centre_crops_not_stretched(tmp_path, crop_fraction):
    """A 32 x 64 image, red | green (the middle half) | blue: the evaluation crop of the shorter side is the
    green middle, through FFCV and through torchvision alike; stretching the whole image would show red and
    blue at the sides."""
    stripes = np.zeros((32, 64, 3), np.uint8)
    stripes[:, :16, 0] = stripes[:, 16:48, 1] = stripes[:, 48:, 2] = 255
    (tmp_path / "images" / "a").mkdir(parents=True)
    Image.fromarray(stripes).save(tmp_path / "images" / "a" / "stripes.png")
    write_image_folder(tmp_path / "images", tmp_path / "stripes.beton", write_mode="raw")
    for source in (tmp_path / "images", tmp_path / "stripes.beton"):
        loader = build_image_loader(source, 16, 1, mean=(0.0,) * 3, std=(1.0,) * 3, num_workers=0 if source.is_dir()
                                    else 1, crop_fraction=crop_fraction)
        (image, _, _), = list(loader)
        red, green, blue = image[0].mean(dim=(1, 2)).tolist()
        assert green > 0.97 and red < 0.03 and blue < 0.03, (source.name, red, green, blue)


@pytest.mark.parametrize("side", [16, 48])     # 48: the CPU resizes views of >= 32 px one by one
def test_full_crop_without_jitter_reproduces_the_canvas(side):
    canvas = torch.randint(0, 256, (3, side, side, 3), dtype=torch.uint8)
    identity = ViewGroup(count=2, size=side, scale=(1.0, 1.0), ratio=(1.0, 1.0), flip_p=0.0, jitter_p=0.0,
                         grayscale_p=0.0)
    views, boxes = augment_views(canvas, torch.full((3, 2), side), [identity], (0.0,) * 3, (1.0,) * 3,
                                 torch.Generator().manual_seed(0))
    expected = canvas.permute(0, 3, 1, 2).float() / 255
    assert torch.allclose(views[0][:, 0], expected, atol=1e-5) and torch.allclose(views[0][:, 1], expected, atol=1e-5)
    assert torch.allclose(boxes[0], torch.tensor([0.0, 0.0, 1.0, 1.0]).expand(3, 2, 4))
    flipped = ViewGroup(**{**identity.__dict__, "flip_p": 1.0, "grayscale_p": 1.0})
    views, _ = augment_views(canvas, torch.full((3, 2), side), [flipped], (0.0,) * 3, (1.0,) * 3,
                             torch.Generator().manual_seed(0))
    gray = (expected * torch.tensor([0.299, 0.587, 0.114]).view(3, 1, 1)).sum(1, keepdim=True).flip(-1)
    assert torch.allclose(views[0][:, 0], gray.expand(3, 3, side, side), atol=1e-5)


def test_one_by_one_resize_of_large_views_draws_the_matmul_views():
    """On the CPU, views of >= 32 px are cropped from whole canvas pixels and resized one by one (uint8); the
    batched matmuls crop the exact box. On a smooth canvas the two give the same views (orientation, flip)."""
    from pretrain.data.augment import crop_resize_flip_by_matmuls, crop_resize_flip_one_by_one

    y, x = torch.meshgrid(torch.arange(96.0), torch.arange(96.0), indexing="ij")
    smooth = torch.stack([x / 95, y / 95, 0.5 + 0.5 * torch.sin((x + 2 * y) / 15)], dim=-1)
    canvas = (255 * smooth).round().to(torch.uint8).expand(4, 96, 96, 3).contiguous()
    boxes = torch.tensor([[0.1, 0.2, 0.6, 0.9], [0.0, 0.0, 1.0, 1.0], [0.55, 0.05, 0.95, 0.45], [0.3, 0.3, 0.7, 0.8]]
                         ).repeat(4, 1)[:4 * 2]
    flip = torch.tensor([False, True] * 4)
    exact = crop_resize_flip_by_matmuls(canvas, boxes, 2, 40, flip, 1 / 255).permute(0, 3, 1, 2)   # channels last
    rounded = crop_resize_flip_one_by_one(canvas, boxes, 2, 40, flip, 1 / 255)                    # channel first
    assert exact.shape == rounded.shape == (8, 3, 40, 40)
    assert (exact - rounded).abs().mean() < 0.01 and (exact - rounded).abs().max() < 0.06


def test_crop_boxes_follow_scale_and_source_aspect():
    hw = torch.tensor([[100, 300]] * 4000)
    boxes = sample_crop_boxes(hw, (0.2, 0.5), (0.75, 1.5), torch.Generator().manual_seed(0))
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    aspect = (boxes[:, 2] - boxes[:, 0]) * 300 / ((boxes[:, 3] - boxes[:, 1]) * 100)
    assert area.min() >= 0.2 - 1e-9 and area.max() <= 0.5 + 1e-9
    assert aspect.min() >= 0.75 - 1e-9 and aspect.max() <= 1.5 + 1e-9


def test_pair_iou_matches_rasterised_boxes():
    generator = torch.Generator().manual_seed(0)
    corners = torch.rand(200, 2, 2, generator=generator).sort(dim=1).values     # (pair, corner, xy)
    boxes_a = torch.cat([corners[:100, 0], corners[:100, 1]], dim=1)
    boxes_b = torch.cat([corners[100:, 0], corners[100:, 1]], dim=1)
    boxes_b[:10] = boxes_a[:10]                                    # identical pairs: IoU 1
    boxes_b[10, :] = torch.tensor([0.9, 0.9, 0.95, 0.95]); boxes_a[10, :] = torch.tensor([0.0, 0.0, 0.1, 0.1])
    grid = (torch.arange(400) + 0.5) / 400
    gx, gy = grid[None, :, None], grid[None, None, :]

    def inside(boxes):
        return ((gx >= boxes[:, 0, None, None]) & (gx < boxes[:, 2, None, None])
                & (gy >= boxes[:, 1, None, None]) & (gy < boxes[:, 3, None, None]))

    in_a, in_b = inside(boxes_a), inside(boxes_b)
    rasterised = (in_a & in_b).sum((1, 2)).float() / (in_a | in_b).sum((1, 2)).clamp(min=1).float()
    iou = pair_iou(boxes_a, boxes_b)
    assert torch.allclose(iou, rasterised, atol=0.02)
    assert torch.allclose(iou[:10], torch.ones(10)) and iou[10] == 0
    assert pair_iou(boxes_a[:, None], boxes_b[None, :5]).shape == (100, 5)          # broadcasting
    assert pair_iou(torch.zeros(4), torch.zeros(4)) == 0                            # empty boxes: 0, not NaN
