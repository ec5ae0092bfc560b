"""Tiny configs, random views and a DeepSpeed engine for the training-step tests (tests/test_engine_step.py,
on the CPU, and tests/gpu/test_gpu_paths.py, on CUDA), and the start of the tests' worker processes."""
import gc
from pathlib import Path

import torch

from pretrain.runtime.bf16_support import cpu_bf16_is_native

ROOT = Path(__file__).parents[1]
CONFIGS = ROOT / "configs/pretrain"
METHOD_CONFIGS = ["simclr_digits.yaml", "simsiam_digits.yaml", "dino_digits.yaml", "tcl_digits.yaml",
                  "supcon_digits.yaml", "contrastive_balance_digits.yaml", "smoco_digits.yaml"]
# DINO's multi-crop: configs/pretrain/dino_digits.yaml trains on its two global crops only, the tests keep 4 local
# crops of 8 px (as the ImageNet configs train), so that every path of the local views stays tested.
DINO_MULTI_CROP = [
    "data.views=[{count: 1, size: 16, scale: [0.4, 1.0], blur_p: 1.0}, "
    "{count: 1, size: 16, scale: [0.4, 1.0], blur_p: 0.1, solarize_p: 0.2}, {count: 4, size: 8, scale: [0.2, 0.5], blur_p: 0.5}]",
    "hvs.num_views=[2, 2, 8]"]
# SMALL_RESNET: timm's test_resnet (0.37 M parameters: BasicBlocks, deep stem, max-pool), for the tests of what the
# engine, a loss or a method's state does with whatever backbone (distributed equality, EMA teachers, clipping):
# the digits presets' ResNet-18 (11.2 M) costs them more in building, gathering and comparing weights than in
# computing. And where bf16 is emulated (pretrain/runtime/bf16_support.py) its cost grows with the weights, not the
# pixels: a bf16 forward and backward of 12 views of 16 px took 5.7 s with ResNet-18 and 0.16 s with test_resnet
# on an AVX2-only EPYC (fp32: 0.17 and 0.02 s); the bf16 tests train it there, ResNet-18 elsewhere.
SMALL_RESNET = ["model.arch=test_resnet", "model.stem=imagenet"]
BF16_TEST_MODEL = [] if cpu_bf16_is_native() else SMALL_RESNET
TINY = ["model.proj_hidden_dim=32", "model.proj_out_dim=16", "data.batch_size=6", "hvs.enabled=true",
        "hvs.max_candidates=8", "optim.lr=0.05"]


def start_worker() -> tuple[int, int]:
    """Start a test's worker process (`python -m tests.test_X`, alone or under torchrun): its process group (rank and
    world size returned), one thread (its tensors are tiny, and two threads wait on each other when another process
    shares the cores), and every object imported so far out of the garbage collector's scans (gc.freeze: DeepSpeed's
    explicit collections and the automatic ones then skip the million objects torch, DeepSpeed and timm leave at
    import; the two-process equality worker's steps took 37 s instead of 42)."""
    import pretrain.methods  # noqa: F401  (with DeepSpeed and timm: what every worker imports, before the freeze)
    import pretrain.runtime.loop  # noqa: F401
    from pretrain.runtime.distributed import init_distributed

    rank, world, _ = init_distributed()
    torch.set_num_threads(1)
    gc.freeze()
    return rank, world


def views_and_boxes(cfg, generator: torch.Generator):
    from pretrain.config import views_to_draw

    groups = views_to_draw(cfg)
    batch = cfg.data.batch_size
    views = [torch.randn(batch, g.count, 3, g.size, g.size, generator=generator) for g in groups]
    boxes = [torch.rand(batch, g.count, 4, generator=generator).sort(dim=-1).values[..., [0, 2, 1, 3]] for g in groups]
    return views, boxes, torch.arange(batch) % 3


def engine_for(cfg, method):
    """(engine, optimizer, gradient_edits) as the training loop builds them
    (`pretrain.runtime.loop.initialize_engine`)."""
    from pretrain.runtime.loop import initialize_engine
    from pretrain.runtime.optim import build_optimizer
    from pretrain.runtime.stage import LoopOptions

    optimizer = build_optimizer(cfg, method.param_groups(), cfg.optim.lr)
    return initialize_engine(method, optimizer, LoopOptions.from_config(cfg))


def one_sgd_step_and_its_reference(cfg, lr: float):
    """A fresh method (seed 0) takes one SGD step of `lr` through the engine, as the loop takes it (`train_step`,
    with the gradient edits), on the views of seed 3; a copy of it made before the step computes the same loss's
    gradients by hand. Returns (method, engine, reference copy, its gradients); the caller compares."""
    import copy

    from pretrain.data.views import ViewBatch
    from pretrain.methods import build_method
    from pretrain.runtime.loop import train_step
    from pretrain.runtime.optim import set_schedule_values
    from pretrain.runtime.task import BatchPosition

    torch.manual_seed(0)
    method = build_method(cfg).train()
    reference = copy.deepcopy(method)
    engine, optimizer, gradient_edits = engine_for(cfg, method)
    engine.train()
    views, boxes, labels = views_and_boxes(cfg, torch.Generator().manual_seed(3))
    set_schedule_values(optimizer, lr, 0.0, lr, 0)
    train_step(engine, method, ViewBatch(views, boxes, labels, torch.arange(len(labels))),
               BatchPosition(0, 0, 0, 0), gradient_edits=gradient_edits)
    outputs = reference(views)
    reference.loss({k: v.float() for k, v in outputs.items()}, labels).backward()
    return method, engine, reference, [p.grad for p in reference.parameters()]
