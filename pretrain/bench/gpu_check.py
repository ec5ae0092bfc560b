"""`python -m pretrain.bench gpu-check`: everything a short GPU lease is for, in one command of at most 8 minutes.

Parts, each a command of its own under its own time limit (a part that runs out is reported as such, and the next
one runs):
1. `tests/gpu` (bf16 against fp32 for every method, selection on the GPU, channels-last, ...);
2. the project's step against a plain PyTorch loop (`bench train`), SimCLR ResNet-50 at 224 px, bf16,
   channels-last, batch 64 and then 256, without and with hard view selection, then DINO ViT-S/16 with its
   multi-crop views (2 x 224 + 8 x 96), bf16, batch 64; the rounds' median and range, and the device-to-host reads
   a step;
3. `bench gpu`: images/s through the FFCV loader on JPEGs (SimCLR ResNet-50 2 x 224, DINO ViT-S/16 multi-crop),
   the median of 10 steps after 5.
It writes OUT_DIR/gpu_check.json (each part's command, exit status, seconds and output's end; the card's name, the
commit) and OUT_DIR/gpu_check.md (the same as a table, then each part's output), and each benchmark's own JSON.

`--dry-run` (run by `make test`, on the CPU) checks that the parts cannot rot between leases: every benchmark
part's command line is parsed by the real parsers, and pytest collects `tests/gpu` (every module imports); nothing
is timed and no report is written.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from pretrain.bench.gpu import add_gpu_command
from pretrain.bench.train import add_train_command
from pretrain.runtime.provenance import read_code_state

LEASE_SECONDS = 480        # the parts' time limits add up to at most this


def gpu_tests_on() -> dict[str, str]:
    """This environment with tests/gpu switched on (tests/conftest.py leaves them out without HARDVIEW_GPU_TESTS)."""
    return {**os.environ, "HARDVIEW_GPU_TESTS": "1"}


def parts(out_dir: Path) -> list[tuple[str, list[str], int]]:
    """(name, command, time limit in seconds) of each part, in order."""
    bench = [sys.executable, "-m", "pretrain.bench"]

    def train(only: str, rounds: int) -> list[str]:
        return ["train", "--imagenet", "--only", only, "--rounds", str(rounds), "--steps", "10", "--warmup", "5",
                "--split-case", "none"]

    # The limits are estimates: no GPU has run the check yet (each side of a round is a process of its own, its
    # start a fixed cost); DINO gets 2 rounds to fit the lease.
    simclr, dino = train("R50", 3), train("ViT-S/16", 2)
    return [("tests/gpu", [sys.executable, "-m", "pytest", "-q", "tests/gpu"], 100),
            ("project step / plain loop, SimCLR R50 224 px, batch 64",
             [*bench, *simclr, "--override", "data.batch_size=64", "engine.channels_last=true",
              "--out", str(out_dir / "train_batch64.json")], 95),
            ("project step / plain loop, SimCLR R50 224 px, batch 256",
             [*bench, *simclr, "--override", "data.batch_size=256", "engine.channels_last=true",
              "--out", str(out_dir / "train_batch256.json")], 95),
            ("project step / plain loop, DINO ViT-S/16 2 x 224 + 8 x 96, batch 64",
             [*bench, *dino, "--override", "data.batch_size=64", "--out", str(out_dir / "train_dino_vit.json")], 80),
            ("bench gpu (the loader feeding JPEGs)",
             [*bench, "gpu", "--images", "1500", "--steps", "10", "--warmup", "5", "--out", str(out_dir / "gpu.json")],
             110)]


def dry_run(out_dir: Path) -> dict:
    """Parse every benchmark part's arguments with the real parsers (`bench train`'s and `bench gpu`'s) and collect
    tests/gpu; run nothing else."""
    parser = argparse.ArgumentParser(prog="python -m pretrain.bench")
    commands = parser.add_subparsers(dest="command", required=True)
    add_train_command(commands)
    add_gpu_command(commands)
    checked = []
    for name, command, _ in parts(out_dir):
        if command[1:3] == ["-m", "pretrain.bench"]:
            parser.parse_args(command[3:])
        else:
            collected = subprocess.run([*command, "--collect-only"], capture_output=True, text=True, env=gpu_tests_on())
            if collected.returncode:            # 5: none collected
                raise SystemExit(f"error: {name}: pytest could not collect them:\n{collected.stdout[-3000:]}"
                                 f"{collected.stderr[-3000:]}")
        checked.append(name)
        print(f"dry run: {name}: ok", flush=True)
    return {"command": "gpu-check", "dry_run": True, "parts": checked}


def run_gpu_check(args: argparse.Namespace) -> dict:
    out_dir = Path(args.out_dir)
    if args.dry_run:
        args.out = None
        return dry_run(out_dir)
    if not torch.cuda.is_available():
        print("error: no CUDA GPU is visible (torch.cuda.is_available() is False): `gpu-check` is for a machine with "
              "one; `--dry-run` checks its parts on the CPU", file=sys.stderr)
        raise SystemExit(2)
    out_dir.mkdir(parents=True, exist_ok=True)
    args.out = str(out_dir / "gpu_check.json")                        # written by `main`
    code = read_code_state()
    card, commit = torch.cuda.get_device_name(0), f"{code.commit}{' (with uncommitted changes)' if code.dirty else ''}"
    results = []
    for name, command, limit in parts(out_dir):
        print(f"== {name} (at most {limit} s)\n$ {' '.join(command)}", flush=True)
        started = time.perf_counter()
        try:
            finished = subprocess.run(command, capture_output=True, text=True, timeout=limit, env=gpu_tests_on())
            status, output = finished.returncode, finished.stdout + finished.stderr
        except subprocess.TimeoutExpired as error:
            status = "timed out"
            output = "".join(part.decode(errors="replace") if isinstance(part, bytes) else (part or "")
                             for part in (error.stdout, error.stderr))
        seconds = round(time.perf_counter() - started, 1)
        print(output[-4000:], flush=True)
        results.append({"part": name, "command": command, "limit_s": limit, "status": status, "seconds": seconds,
                        "output_end": output[-6000:]})
    report = {"command": "gpu-check", "card": card, "commit": commit, "torch": torch.__version__, "parts": results}
    lines = [f"# GPU check on {card} at commit {commit} (torch {torch.__version__})", "",
             "| part | status | seconds (limit) |", "| --- | --- | --- |",
             *(f"| {r['part']} | {r['status']} | {r['seconds']} ({r['limit_s']}) |" for r in results)]
    for r in results:
        lines += ["", f"## {r['part']}", "", f"`{' '.join(r['command'])}`", "", "```", r["output_end"].rstrip(), "```"]
    (out_dir / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out_dir / 'gpu_check.md'}")
    return report


def add_gpu_check_command(commands) -> None:
    parser = commands.add_parser("gpu-check", help="tests/gpu, the step against a plain loop and bench gpu, in at most "
                                                   f"{LEASE_SECONDS // 60} minutes on a GPU (--dry-run: on the CPU)",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="parse the parts' command lines and collect tests/gpu; time nothing (on any machine)")
    parser.add_argument("--out-dir", default="bench/gpu_check", help="where the reports go (default: bench/gpu_check)")
    parser.set_defaults(run=run_gpu_check, out=None)

