"""`python -m pretrain.bench train`: the whole pretraining step against a plain PyTorch loop of the same model.

Per case (a config, with or without hard view selection), on the same fixed view tensors (the loader left out: its
cost is `bench loader`'s and the split's "data" row):
- this project: the real training loop (`pretrain.runtime.loop.run_training` with the real `Pretraining` stage:
  DeepSpeed engine, the method's `batch_loss` with selection and the online monitors, the finite-loss and
  stop-signal all-reduces, logging), timed between consecutive optimizer steps;
- the plain loop, written here: the same method module (backbone, heads, loss; hard view selection by the same
  `select_hard_views`) and the same torch optimizer, `loss.backward(); optimizer.step()`, nothing else.
Each case runs --rounds rounds (default 5); a round times the project and the plain loop, each in a process of its
own, the order alternating from round to round (project then plain, plain then project, ...) so that a drift of the
machine's speed falls on both sides alike. A side's images/s in a round is the median over its timed steps after the
warm-up; the round's ratio plain / project (the project's overhead) is taken from that round's two runs. The table
quotes, per case, the median and the range of the rounds' ratios and each side's median images/s; the JSON keeps every
round. No best-of is taken anywhere: the rounds' spread is the measure's noise, and it is quoted beside the median.
`--plain-variants` times the plain loop's variants the same way (one process per variant per round, the order
reversed from round to round). The heading names the machine: the GPU, or the CPU's model, whether it has AVX-512,
AVX-512 BF16 and AMX, and torch's instruction set; the cores and threads.
On a machine with a CUDA GPU both run on the GPU (the project as `python -m pretrain` would: bf16 under
`engine.precision=auto`, channels-last where `engine.channels_last` asks; the plain loop the same), each step ended
by `torch.cuda.synchronize()` before its time is read.
Then the project's step split by phase (torch.profiler over `record_function` ranges the loop and the methods
mark: `hardview/...`), the step on 2 processes (gloo, the same global batch), and the step while K busy
processes share the cores, against the fair share (idle rate / (K + 1)).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile as profiler

from pretrain.bench.machine import machine_heading, this_machine
from pretrain.bench.train_tables import print_tables
from pretrain.bench.precision import median_and_range
from pretrain.data.views import ViewBatch
from pretrain.hvs import select_hard_views
from pretrain.runtime.argument_types import positive_int
from pretrain.runtime.device_reads import DeviceReads
from pretrain.runtime.distributed import init_distributed, release_distributed

FASHION_MNIST = ["configs/pretrain/simclr_fashion_mnist.yaml", "configs/pretrain/simsiam_fashion_mnist.yaml",
                 "configs/pretrain/dino_fashion_mnist.yaml", "configs/pretrain/tcl_fashion_mnist.yaml"]
IMAGENET_CASE = ("configs/pretrain/simclr_imagenet_folder.yaml", ["data.batch_size=8"])
DINO_VIT_CASE = ("configs/pretrain/dino_vit_small_imagenet_folder.yaml", ["data.batch_size=8"])


def cases(imagenet: bool) -> list[tuple[str, str, list[str]]]:
    """(name, config, overrides): each Fashion-MNIST config without and with selection (its own hvs.num_views),
    and, with `imagenet`, SimCLR ResNet-50 at 224 px, batch 8, without and with selection (4 views), and DINO's
    ViT-S/16 preset with its multi-crop views (2 x 224 + 8 x 96), batch 8."""
    rows = []
    for config in FASHION_MNIST:
        method = Path(config).stem.replace("_fashion_mnist", "")
        rows += [(method, config, []), (f"{method} HVS", config, ["hvs.enabled=true"])]
    if imagenet:
        config, overrides = IMAGENET_CASE
        rows += [("simclr R50 224 px", config, overrides),
                 ("simclr R50 224 px HVS", config, [*overrides, "hvs.enabled=true", "hvs.num_views=[4]"]),
                 ("dino ViT-S/16 2x224+8x96", *DINO_VIT_CASE)]
    return rows


def selected_cases(args: argparse.Namespace) -> list[tuple[str, str, list[str]]]:
    """The cases the command times: those `--only` names, each with `--override` after its own overrides."""
    return [(name, config, [*overrides, *args.override]) for name, config, overrides in cases(args.imagenet)
            if not args.only or any(word in name for word in args.only)]


def split_case(args: argparse.Namespace) -> tuple[str, str, list[str]]:
    """`--split-case`, a Fashion-MNIST case, with `--override` as every other table has it."""
    name, config, overrides = next(case for case in cases(False) if case[0] == args.split_case)
    return name, config, [*overrides, *args.override]


def fixed_batch(cfg, device: torch.device):
    """One ViewBatch of random views of the sizes the loader would draw (the pool under selection), on `device`."""
    # heavy: omegaconf, cv2, for this benchmark only (see pretrain/bench/__init__.py)
    from pretrain.config import views_to_draw

    generator = torch.Generator().manual_seed(0)
    batch = cfg.data.batch_size
    groups = views_to_draw(cfg)
    views = [torch.randn(batch, g.count, 3, g.size, g.size, generator=generator) for g in groups]
    boxes = [torch.rand(batch, g.count, 4, generator=generator).sort(dim=-1).values[..., [0, 2, 1, 3]] for g in groups]
    return ViewBatch([v.to(device) for v in views], [b.to(device) for b in boxes], (torch.arange(batch) % 10).to(device),
                     torch.arange(batch).to(device))


def finish_step(device: torch.device) -> float:
    """The time once the step's work is done: on a GPU, after the queued kernels have run."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class FixedViews:
    """The loop's loader (`EpochLoader`), handing over the same batch `steps` times per epoch."""

    def __init__(self, batch, steps: int):
        self.batch, self.steps, self.num_images = batch, steps, batch.batch_size * steps

    def __len__(self) -> int:
        return self.steps

    def epoch(self, epoch: int, start_batch: int = 0):
        for _ in range(start_batch, self.steps):
            yield self.batch


def project_step_seconds(cfg, steps: int, profile: bool = False,
                         reads: DeviceReads | None = None) -> tuple[list[float], dict[str, float]]:
    """Seconds between consecutive optimizer steps of the real loop on a fixed batch; with `profile`, the CPU
    milliseconds per step of every `hardview/...` range the loop and the methods mark; with `reads`, the device-to-host
    reads counted per step (`reads.reads[0]`: before the first step; `reads.reads[i]`: step i's, from the loop's
    `set_schedule_values` at its start to the next step's, its logging and checkpoint included)."""
    # heavy: deepspeed, timm, omegaconf, cv2, for this benchmark only (see pretrain/bench/__init__.py)
    from pretrain.pretraining import Pretraining
    from pretrain.runtime import loop

    stamps: list[float] = []

    class Stage(Pretraining):
        def check_inputs(self) -> None:          # no data files: the batch is made here
            pass

        def build_loader(self, rank, world_size, device):
            return FixedViews(fixed_batch(self.cfg, device), steps)

        def build_task(self, steps_per_epoch, schedule_steps, device):
            method = super().build_task(steps_per_epoch, schedule_steps, device)
            after_step = method.after_step

            def timed_after_step(step: int) -> None:
                after_step(step)
                stamps.append(finish_step(device))
            method.after_step = timed_after_step
            return method

    phases = {}
    set_schedule_values = loop.set_schedule_values            # the start of every optimizer step

    def start_of_a_step(*args, **kwargs) -> None:
        reads.mark_step()
        set_schedule_values(*args, **kwargs)
    if reads is not None:
        loop.set_schedule_values = start_of_a_step
    try:                  # the group of one ends with the run: a process started later must not take it for its own
        with profiler(activities=[ProfilerActivity.CPU]) if profile else nullcontext() as prof, reads or nullcontext():
            loop.run_training(Stage(cfg))
    finally:
        loop.set_schedule_values = set_schedule_values
        release_distributed()
    if profile:           # the checkpoint at the end is once per run, not per step: left out
        for event in prof.key_averages():
            if event.key.startswith("hardview/") and event.key != "hardview/checkpoint":
                phases[event.key] = event.cpu_time_total / 1000 / steps
    return list(np.diff(stamps)), phases


PLAIN_VARIANTS = ("channels_last", "compile", "bf16")


def plain_step_seconds(cfg, steps: int, device: torch.device, variant: str | None = None) -> list[float]:
    """Seconds per step of a plain PyTorch loop of the same method module and optimizer on the same batch, on
    `device` with the precision and memory format the project would use there; a `variant` of PLAIN_VARIANTS
    measures what the loop would gain from it: channels-last convolutions (as `engine.channels_last` gives),
    `torch.compile` of the backbone, or bf16 autocast (as `engine.precision=bf16` gives)."""
    # heavy: deepspeed, timm, omegaconf, cv2, for this benchmark only (see pretrain/bench/__init__.py)
    from pretrain.methods import build_method
    from pretrain.runtime.loop import channels_last_inputs
    from pretrain.runtime.stage import LoopOptions, uses_bf16
    from pretrain.runtime.optim import build_optimizer

    torch.manual_seed(cfg.seed)
    method = build_method(cfg, steps).to(device).train()
    optimizer = build_optimizer(cfg, method.param_groups(), cfg.optim.lr)
    batch = fixed_batch(cfg, device)
    bf16 = variant == "bf16" or uses_bf16(LoopOptions.from_config(cfg), device)
    if variant == "channels_last" or (device.type == "cuda" and cfg.engine.channels_last):
        channels_last_inputs(method)                # as the project's loop does (engine.channels_last)
    if variant == "compile":
        method.backbone = torch.compile(method.backbone)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        plain_step(cfg, method, optimizer, batch, step, bf16)
        times.append(finish_step(device) - start)
    return times


def plain_step(cfg, method, optimizer, batch: ViewBatch, step: int, bf16: bool) -> torch.Tensor:
    """The plain loop's step `step` (from 0): hard view selection when cfg.hvs.enabled (the same
    `select_hard_views`), the method's forward under bf16 autocast when `bf16`, its loss in fp32, backward, the
    optimizer's step, the method's after-step updates (EMA teachers, queues). Returns the loss. Its loss and
    gradients equal the project's step on the same batch (tests/test_bench.py), so the benchmark times the same work.
    """
    views = batch.views
    if cfg.hvs.enabled:
        views = select_hard_views(method, method, batch.views, batch.boxes, batch.labels, method.train_counts,
                                  cfg.hvs.mode, cfg.hvs.selection_size, cfg.hvs.max_candidates,
                                  random.Random(step)).views
    device_type = next(method.parameters()).device.type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
        outputs = method(views)
    loss = method.loss({name: tensor.float() for name, tensor in outputs.items()}, batch.labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    method.after_step(step + 1)
    return loss.detach()


def case_config(config: str, overrides: list[str], run_dir: Path, steps: int, data: Path | None):
    # heavy: omegaconf, cv2, for this benchmark only (see pretrain/bench/__init__.py)
    from pretrain.config import load_config

    train = [f"data.train={data / 'train.beton'}"] if data is not None else []      # its classes size the probe
    return load_config(config, [*overrides, *train, f"run_dir={run_dir}", f"engine.max_steps={steps}",
                                "engine.checkpoint_every_steps=0", "engine.image_grid_every_steps=0",
                                "engine.print_every_steps=1000000", "engine.keep_checkpoints=1"])


def images_per_s(cfg, seconds: list[float], warmup: int) -> float:
    return cfg.data.batch_size / float(np.median(seconds[warmup:]))


def run_case(args: argparse.Namespace) -> dict:
    """One case in this process (`train-case`): the project's step, or with --plain the plain loop's."""
    case = json.loads(args.case)
    with tempfile.TemporaryDirectory() as work:
        data = Path(case["data"]) if case.get("data") else None
        cfg = case_config(case["config"], case["overrides"], Path(work) / "run", case["steps"], data)
        if case.get("plain"):
            _, _, device = init_distributed()     # a group of one (DINO's centre is all-reduced), on the GPU if any
            seconds = plain_step_seconds(cfg, case["steps"], device, case.get("variant"))
            release_distributed()
        elif case.get("count_reads"):       # a run of its own: the timed runs go unpatched
            reads = DeviceReads()
            seconds, _ = project_step_seconds(cfg, case["steps"], reads=reads)
            return {"seconds": seconds, "reads": reads.per_step(),
                    "read_sites": [dict(step) for step in reads.reads]}
        else:
            seconds, _ = project_step_seconds(cfg, case["steps"])
    return {"seconds": seconds}


# OpenMP's waiting in the contention table's processes: this project's (pretrain/__init__.py: sleep after 1000 spins),
# sleeping at once, and libgomp's own default (spin about 3 ms, then sleep), which empty values give (libgomp warns
# and ignores them; the project keeps a value that is set).
WAIT_POLICIES = {"passive, 1000 spins": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"},
                 "passive, no spin": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"},
                 "libgomp default": {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": ""}}


def timed_in_a_process(case: dict, processes: int = 1, environ: dict | None = None) -> list[float]:
    """Run one case in a process of its own (or `processes` under torchrun); the seconds of its steps (rank 0)."""
    return case_in_a_process(case, processes, environ)["seconds"]


def case_in_a_process(case: dict, processes: int = 1, environ: dict | None = None) -> dict:
    """Run one case in a process of its own (or `processes` under torchrun); what `run_case` returned on rank 0:
    the seconds of its steps, and with "count_reads" (the project's side) its device-to-host reads per step
    (`DeviceReads`)."""
    launcher = [sys.executable, "-m", "pretrain.bench"] if processes == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}", "-m",
         "pretrain.bench"]
    finished = subprocess.run([*launcher, "train-case", "--case", json.dumps(case)], capture_output=True, text=True,
                              env={**os.environ, **(environ or {})})
    if finished.returncode:
        raise SystemExit(f"error: the case {json.dumps(case)} failed:\n{finished.stderr[-3000:]}")
    return json.loads([line for line in finished.stdout.splitlines() if line.startswith("{")][0])


def alternating_rounds(sides: dict[str, dict], rounds: int, cfg, warmup: int, label: str) -> list[dict]:
    """Each of `sides` (name -> a case for `timed_in_a_process`) timed once per round, each run in a process of its own,
    the order reversed from one round to the next (A B, B A, A B, ...; with more sides A B C, C B A, ...): a drift
    of the machine's speed over the rounds (another job starting or ending, the clock) then falls on every side alike,
    where a fixed order would hand it to whichever side runs last. Per round, each side's images/s (the median over
    its steps after the warm-up) and the order: [{NAME: images/s, ..., "order": [NAME, ...]}, ...]. A ratio
    between sides is to be taken within a round, and the rounds quoted as median and range (`median_and_range`),
    never as the best of them."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: at least one round is needed to time anything")
    results = []
    for round_ in range(rounds):
        order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
        result: dict[str, Any] = {name: images_per_s(cfg, timed_in_a_process(sides[name]), warmup) for name in order}
        result["order"] = order
        results.append(result)
        print(f"  {label:<24} round {round_ + 1}/{rounds}: "
              + ", ".join(f"{name} {result[name]:.1f}" for name in order) + " images/s", flush=True)
    return results


def project_against_plain(name: str, cfg, common: dict, rounds: int, warmup: int) -> dict:
    """One case's row of the table: the project and the plain loop in `rounds` alternating rounds
    (`alternating_rounds`), each round's ratio plain / project from its own two runs; each side's images/s and the
    ratio as median and range over the rounds, and every round as measured."""
    timed = alternating_rounds({"project": {**common, "plain": False}, "plain": {**common, "plain": True}},
                               rounds, cfg, warmup, name)
    per_round = [{"project": round(r["project"], 1), "plain": round(r["plain"], 1),
                  "ratio": round(r["plain"] / r["project"], 3), "order": r["order"]} for r in timed]
    reads = case_in_a_process({**common, "plain": False, "count_reads": True})["reads"]   # one more run
    return {"case": name, "batch": cfg.data.batch_size, "reads": reads_per_step(reads, cfg.engine.log_every_steps),
            "project_images_per_s": median_and_range([r["project"] for r in timed]),
            "plain_images_per_s": median_and_range([r["plain"] for r in timed]),
            "plain_over_project": median_and_range([r["plain"] / r["project"] for r in timed]),
            "rounds": per_round}


def reads_per_step(reads: list[int], log_every: int) -> dict:
    """The device-to-host reads of a run's steps (`DeviceReads.per_step`: index 0 before the first step): the most
    of a step that neither logs nor checkpoints (the bench's runs checkpoint at their last step only), and of a step
    that logs."""
    steps = range(1, len(reads))
    return {"quiet_step_max": max((reads[s] for s in steps if s % log_every and s != steps[-1]), default=0),
            "logging_step_max": max((reads[s] for s in steps if not s % log_every), default=0), "per_step": reads[1:]}


def busy_processes(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def run_train_benchmark(args: argparse.Namespace) -> dict:
    # heavy: omegaconf, cv2, for this benchmark only (see pretrain/bench/__init__.py)
    from pretrain.config import load_config

    data = Path(args.data_dir)
    if not (data / "train.beton").exists():
        subprocess.run([sys.executable, "-m", "pretrain.data", "write-fashion-mnist", "--out-dir", str(data)],
                       check=True)
    steps = args.warmup + args.steps
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    machine = this_machine()
    print(f"{machine_heading(machine)}, 1-minute load average before: {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    for name, config, overrides in selected_cases(args):
        cfg = load_config(config, overrides)
        common = {"config": config, "overrides": overrides, "steps": steps, "data": str(data)}
        rows.append(project_against_plain(name, cfg, common, args.rounds, args.warmup))
    result = {"command": "train", "device": device, "machine": machine, "cores": os.cpu_count(),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "overrides": args.override,
              "rows": rows, "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds}
    if args.plain_variants:
        result["plain_variants"] = plain_variants(args, data)
    if args.split_case != "none":
        case = split_case(args)
        result["split"] = step_split(case, args, data)
        result["processes"] = two_processes(case, args, data)
        result["contention"] = contention(case, args, data)
    result["load_average_1min"] = os.getloadavg()[0]
    print_tables(result)
    return result


def plain_variants(args, data: Path) -> list[dict]:
    """The plain loop of each selected case as it is and with each variant (PLAIN_VARIANTS), in --rounds
    alternating rounds (`alternating_rounds`): what channels-last, torch.compile or bf16 autocast would buy before
    anything is built for them. Per case and variant, images/s and the ratio variant / as it is within each round,
    as median and range over the rounds."""
    # heavy: omegaconf, cv2, for this benchmark only (see pretrain/bench/__init__.py)
    from pretrain.config import load_config

    rows = []
    for name, config, overrides in selected_cases(args):
        cfg = load_config(config, overrides)
        common = {"config": config, "overrides": overrides, "steps": args.warmup + args.steps, "data": str(data),
                  "plain": True}
        sides = {variant or "as it is": {**common, "variant": variant} for variant in (None, *args.plain_variants)}
        timed = alternating_rounds(sides, args.rounds, cfg, args.warmup, f"plain loop {name}")
        for variant in sides:
            rows.append({"case": name, "variant": variant,
                         "plain_images_per_s": median_and_range([r[variant] for r in timed]),
                         "over_as_it_is": median_and_range([r[variant] / r["as it is"] for r in timed]),
                         "rounds": [round(r[variant], 1) for r in timed]})
    return rows


def step_split(case, args, data: Path) -> dict:
    """The project's step by phase (profiled in this process), with the loader's time per batch for the same
    recipe (the real FFCV loader on the Fashion-MNIST .beton), in milliseconds per step."""
    # heavy: omegaconf, cv2, for this benchmark only (see pretrain/bench/__init__.py)
    from pretrain.config import load_config, views_to_draw
    from pretrain.data.loader import build_view_loader

    name, config, overrides = case
    with tempfile.TemporaryDirectory() as work:
        cfg = case_config(config, overrides, Path(work) / "run", args.warmup + args.steps, data)
        seconds, phases = project_step_seconds(cfg, args.warmup + args.steps, profile=True)
    loader_cfg = load_config(config, overrides)
    loader = build_view_loader(data / "train.beton", views_to_draw(loader_cfg), loader_cfg.data.batch_size,
                               canvas_size=loader_cfg.data.canvas_size, mean=tuple(loader_cfg.data.mean),
                               std=tuple(loader_cfg.data.std), num_workers=loader_cfg.data.num_workers)
    batches = loader.epoch(0)
    for _ in range(3):
        next(batches)
    start, count = time.perf_counter(), 0
    for batch in batches:
        count += 1
        if count == 30:
            break
    data_ms = 1000 * (time.perf_counter() - start) / count
    step_ms = 1000 * float(np.median(seconds[args.warmup:]))
    return {"case": name, "step_ms_profiled": step_ms, "phases_ms": phases, "loader_ms_per_batch": data_ms}


def two_processes(case, args, data: Path) -> dict:
    """The same global batch on 1 and on 2 processes (gloo), images/s of the global batch."""
    # heavy: omegaconf, cv2, for this benchmark only (see pretrain/bench/__init__.py)
    from pretrain.config import load_config

    name, config, overrides = case
    batch = load_config(config, overrides).data.batch_size
    common = {"config": config, "steps": args.warmup + args.steps, "data": str(data)}
    one = batch / float(np.median(timed_in_a_process({**common, "overrides": overrides})[args.warmup:]))
    halves = [*overrides, f"data.batch_size={batch // 2}"]
    two = batch / float(np.median(timed_in_a_process({**common, "overrides": halves}, processes=2)[args.warmup:]))
    return {"case": name, "global_batch": batch, "one_process_images_per_s": one, "two_processes_images_per_s": two}


def contention(case, args, data: Path) -> list[dict]:
    """The project's step alone and beside K busy processes (`while True: pass`), against the fair share, with
    OpenMP's threads sleeping at barriers after 1000 spins (this project's setting), at once, and after libgomp's
    default spin."""
    # heavy: omegaconf, cv2, for this benchmark only (see pretrain/bench/__init__.py)
    from pretrain.config import load_config

    name, config, overrides = case
    batch = load_config(config, overrides).data.batch_size
    common = {"config": config, "overrides": overrides, "steps": args.warmup + args.steps, "data": str(data)}
    rows = []
    for policy, value in WAIT_POLICIES.items():
        idle = None
        for k in (0, *args.busy):
            others = busy_processes(k)
            try:
                seconds = timed_in_a_process(common, environ=value)
            finally:
                for process in others:
                    process.kill()
                    process.wait()
            rate = batch / float(np.median(seconds[args.warmup:]))
            idle = idle or rate
            fair = idle / (k + 1)
            rows.append({"case": name, "wait_policy": policy, "busy_processes": k, "images_per_s": rate,
                         "fair_share": fair, "of_fair_share": rate / fair})
    return rows


def add_train_command(commands) -> None:
    parser = commands.add_parser("train", help="the pretraining step against a plain PyTorch loop of the same model",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=20, help="timed steps per run (default: 20)")
    parser.add_argument("--warmup", type=positive_int, default=5, help="untimed steps first (default: 5)")
    parser.add_argument("--rounds", type=positive_int, default=5,
                        help="rounds per case, each timing the project and the plain loop in processes of their own, "
                             "the order alternating; the table quotes the rounds' median and range (default: 5)")
    parser.add_argument("--imagenet", action="store_true",
                        help="also SimCLR ResNet-50 at 224 px and DINO ViT-S/16 multi-crop, batch 8 (on 2 CPU cores "
                             "about a minute more per variant; --only R50 or --only ViT-S/16 times one)")
    parser.add_argument("--only", nargs="+", metavar="WORD", help="only the cases whose name holds one of these")
    parser.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides for every case, e.g. engine.precision=bf16")
    parser.add_argument("--split-case", default="simclr", choices=[*(c[0] for c in cases(False)), "none"],
                        help="the case split by phase, run on 2 processes and beside busy ones, or none "
                             "(default: simclr)")
    parser.add_argument("--plain-variants", nargs="*", choices=PLAIN_VARIANTS, default=[],
                        help="also time the plain loop of the selected cases with these: channels_last, compile "
                             "(torch.compile of the backbone), bf16 (autocast)")
    parser.add_argument("--busy", nargs="*", type=positive_int, default=[1, 2],
                        help="numbers of busy processes beside the step (default: 1 2)")
    parser.add_argument("--data-dir", default="data/fashion_mnist",
                        help="the Fashion-MNIST .beton files (the loader's row, the probe's classes; written when "
                             "missing; default: data/fashion_mnist)")
    parser.add_argument("--out", default="bench/train.json", help="where the JSON result goes")
    parser.set_defaults(run=run_train_benchmark)
    case = commands.add_parser("train-case", help="one case of `bench train`, measured in a process of its "
                                                    "own (`bench train` runs it; not for use by hand)")
    case.add_argument("--case", required=True, help="the case's name, as `bench train` names it")
    case.set_defaults(run=lambda args: print(json.dumps(run_case(args))) or {}, out=None)
