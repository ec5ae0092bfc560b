"""`python -m pretrain.bench precision`: what bf16 autocast costs or gains on this CPU, against fp32, measured the same
way in alternating rounds.

The step is the reference step of the test suite (tests/machine_speed.py): one forward, backward and SGD step of the
project's ResNet-18 with its stride-2 stem (--arch, --stem: another backbone) on a batch of 16-px images. Each round
times one step of each precision (after one untimed warm-up step of each); the table gives each precision's median step
and range over the rounds, and the ratio bf16 / fp32 of each round as median and range. The CPU is named, with whether
it has native bf16 (pretrain/runtime/bf16_support.py) and torch's instruction set (ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA
cap it).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pretrain.runtime.argument_types import positive_int


class ReferenceStep:
    """One training step of the project's ResNet-18 (stride-2 stem; or another `arch` and `stem`, as model.arch and
    model.stem) on a fixed batch of `batch` `side`-px images, fp32 weights; `seconds(bf16)` times one step, under bf16
    autocast when asked."""

    def __init__(self, batch: int = 256, side: int = 16, arch: str = "resnet18", stem: str = "small_stride2"):
        from pretrain.models import create_backbone

        torch.manual_seed(0)
        self.backbone = create_backbone(arch, stem).train()
        self.optimizer = torch.optim.SGD(self.backbone.parameters(), lr=0.01)
        self.images = torch.randn(batch, 3, side, side)

    def seconds(self, bf16: bool = False) -> float:
        start = time.perf_counter()
        self.optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            features = self.backbone(self.images)
        features.float().square().mean().backward()
        self.optimizer.step()
        return time.perf_counter() - start


def median_and_range(values: list[float]) -> dict:
    """How the timing benchmarks quote rounds: the median and the range, never a best-of."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_precision_benchmark(args: argparse.Namespace) -> dict:
    from pretrain.runtime.bf16_support import cpu_bf16_is_native, cpu_description

    step = ReferenceStep(args.batch_size, args.size, args.arch, args.stem)
    step.seconds(False), step.seconds(True)                       # warm-up: allocator, oneDNN's kernels
    fp32, bf16 = [], []
    for round_ in range(args.rounds):
        fp32.append(step.seconds(False))
        bf16.append(step.seconds(True))
        print(f"round {round_ + 1}/{args.rounds}: fp32 {fp32[-1]:.3f} s, bf16 {bf16[-1]:.3f} s", flush=True)
    ratios = [b / f for b, f in zip(bf16, fp32)]
    result = {"cpu": cpu_description(), "native_bf16": cpu_bf16_is_native(), "threads": torch.get_num_threads(),
              "arch": args.arch, "stem": args.stem, "batch_size": args.batch_size, "size": args.size, "rounds": args.rounds,
              "fp32_step_s": median_and_range(fp32), "bf16_step_s": median_and_range(bf16), "bf16_over_fp32": median_and_range(ratios)}
    print(f"\n{args.arch} ({args.stem} stem) training step, batch {args.batch_size} of {args.size} px, {result['threads']} "
          f"threads, {args.rounds} alternating rounds\non {result['cpu']}, native bf16: "
          f"{'yes' if result['native_bf16'] else 'no (emulated)'}\n")
    print("| precision | step (s), median | range | images/s, median |")
    print("| --- | --- | --- | --- |")
    for name, key in (("fp32", "fp32_step_s"), ("bf16 autocast", "bf16_step_s")):
        s = result[key]
        print(f"| {name} | {s['median']:.3f} | {s['min']:.3f}-{s['max']:.3f} | {args.batch_size / s['median']:.0f} |")
    r = result["bf16_over_fp32"]
    print(f"\nbf16 / fp32 step time, per round: median {r['median']:.2f}x, range {r['min']:.2f}-{r['max']:.2f}x")
    return result


def add_precision_command(commands) -> None:
    parser = commands.add_parser("precision", help="bf16 autocast against fp32 on this CPU: the same step, alternating",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=positive_int, default=32, help="images per step (default 32)")
    parser.add_argument("--size", type=positive_int, default=16, help="image side in pixels (default 16)")
    parser.add_argument("--arch", default="resnet18", help="the backbone, as model.arch (default resnet18)")
    parser.add_argument("--stem", default="small_stride2", help="its stem, as model.stem (default small_stride2)")
    parser.add_argument("--rounds", type=positive_int, default=5,
                        help="alternating rounds, one step of each (default 5)")
    parser.add_argument("--out", default="bench/precision.json", help="where the JSON result goes")
    parser.set_defaults(run=run_precision_benchmark)
