"""Tiny configs, random views and a DeepSpeed engine for the training-step tests (tests/test_engine_step.py,
on the CPU, and tests/gpu/test_gpu_paths.py, on CUDA)."""
from pathlib import Path

import torch

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
TINY = ["model.proj_hidden_dim=32", "model.proj_out_dim=16", "data.batch_size=6", "hvs.enabled=true",
        "hvs.max_candidates=8", "optim.lr=0.05"]


def views_and_boxes(cfg, generator: torch.Generator):
    from pretrain.config import views_to_draw

    groups = views_to_draw(cfg)
    batch = cfg.data.batch_size
    views = [torch.randn(batch, g.count, 3, g.size, g.size, generator=generator) for g in groups]
    boxes = [torch.rand(batch, g.count, 4, generator=generator).sort(dim=-1).values[..., [0, 2, 1, 3]] for g in groups]
    return views, boxes, torch.arange(batch) % 3


def engine_for(cfg, method):
    """(engine, optimizer, gradient_edits) as the training loop builds them (`pretrain.loop.initialize_engine`)."""
    from pretrain.loop import LoopOptions, initialize_engine
    from pretrain.optim import build_optimizer

    optimizer = build_optimizer(cfg, method.param_groups(), cfg.optim.lr)
    return initialize_engine(method, optimizer, LoopOptions.from_config(cfg))
