"""`python -m pretrain.bench hvs`: the training step's time with hard view selection (N=4, at full and at half
resolution) over the step without (N=2), same batch, as ratios from one run."""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from pretrain.data.views import ViewBatch
from pretrain.runtime.distributed import init_distributed
from pretrain.runtime.task import BatchPosition


def time_train_steps(cfg, steps: int, warmup: int) -> float:
    """Median seconds of one training step (selection pass included when cfg.hvs.enabled) on fixed
    random views: the model's cost alone, without the loader."""

    # heavy: deepspeed, timm, omegaconf, cv2, for this benchmark only (see pretrain/bench/__init__.py)
    from pretrain.config import views_to_draw
    from pretrain.methods import build_method
    from pretrain.runtime.loop import initialize_engine, train_step
    from pretrain.runtime.optim import build_optimizer
    from pretrain.runtime.stage import LoopOptions

    torch.manual_seed(0)
    method = build_method(cfg)
    optimizer = build_optimizer(cfg, method.param_groups(), cfg.optim.lr)
    engine, _, gradient_edits = initialize_engine(method, optimizer, LoopOptions.from_config(cfg))
    batch = cfg.data.batch_size
    groups = views_to_draw(cfg)
    views = [torch.randn(batch, g.count, 3, g.size, g.size) for g in groups]
    boxes = [torch.tensor([0.0, 0.0, 1.0, 1.0]).expand(batch, g.count, 4) for g in groups]
    labels = torch.arange(batch) % 10
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        train_step(engine, method, ViewBatch(views, boxes, labels, torch.arange(batch)), BatchPosition(step, 0, 0, 0),
                   gradient_edits=gradient_edits)
        times.append(time.perf_counter() - start)
    return float(np.median(times[warmup:]))


def run_hvs_benchmark(args: argparse.Namespace) -> dict:
    # heavy: omegaconf, cv2, for this benchmark only (see pretrain/bench/__init__.py)
    from pretrain.config import load_config

    init_distributed()
    rows = []
    for config in args.configs:
        method = load_config(config).method.name
        common = [f"data.batch_size={args.batch_size}", f"data.views.0.size={args.size}"]
        if method == "simsiam":
            common += ["model.proj_out_dim=512", "model.pred_hidden_dim=128"]
        common += args.override
        variants = [("N=2, no selection", ["hvs.enabled=false"]),
                    ("N=4, HVS", ["hvs.enabled=true", "hvs.num_views=[4]"]),
                    (f"N=4, HVS, selection at {args.size // 2} px",
                     ["hvs.enabled=true", "hvs.num_views=[4]", f"hvs.selection_size={args.size // 2}"])]
        baseline = None
        for name, overrides in variants:
            cfg = load_config(config, common + overrides)
            seconds = time_train_steps(cfg, args.steps, args.warmup)
            baseline = baseline or seconds
            rows.append({"method": method, "variant": name, "step_s": seconds, "ratio": seconds / baseline})
    print(f"\ntraining-step time, batch {args.batch_size}, {args.size} px, "
          f"median of {args.steps} steps ({torch.get_num_threads()} threads)")
    print(f"{'method':<9}{'variant':<34}{'step (s)':>10}{'x N=2':>8}")
    for row in rows:
        print(f"{row['method']:<9}{row['variant']:<34}{row['step_s']:>10.3f}{row['ratio']:>8.2f}")
    result = {"configs": args.configs, "overrides": args.override, "batch_size": args.batch_size, "size": args.size,
              "rows": rows}
    return result


def add_hvs_command(commands) -> None:
    parser = commands.add_parser(
        "hvs", help="training-step time with hard view selection (N=4) over without (N=2), same batch",
        description="Times the real training step (DeepSpeed engine, method, selection pass) on fixed random "
                    "views, with and without hard view selection, and prints the ratio measured in one run.")
    parser.add_argument("--configs", nargs="+", help="pair-method configs to time (one view group of 2)",
                        default=["configs/pretrain/simclr_digits.yaml", "configs/pretrain/simsiam_digits.yaml"])
    parser.add_argument("--batch-size", type=int, default=128, help="images per step")
    parser.add_argument("--size", type=int, default=16, help="view side in pixels")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (allocator, oneDNN warm-up)")
    parser.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides for every config and variant, e.g. model.arch=resnet50")
    parser.add_argument("--out", default="bench/hvs.json", help="where the JSON result goes")
    parser.set_defaults(run=run_hvs_benchmark)
