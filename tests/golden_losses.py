"""Golden losses: the first 20 steps of every digits preset, stored in tests/golden/losses.json and compared by
tests/test_golden_losses.py, so that a change no other test looks for (a loss's reduction, an augmentation's
parameter, a schedule's warm-up, the data's order) shows up as moved numbers.

    python -m tests.golden_losses            # the presets' runs now, against the stored values: what moved
    python -m tests.golden_losses --write    # store them (then `git diff tests/golden/losses.json` shows what moved)

Each preset runs `python -m pretrain --config configs/pretrain/PRESET.yaml` on the digits (written as the test
suite writes them) for 20 steps, logging every step, at a small batch. What is stored per step: the loss and, with
hard view selection on, the loss and IoU of the chosen views (`hvs/selected_loss`, `hvs/selected_iou`): the picks'
fingerprint (the picks themselves are not logged).

The tolerance covers what differs between CPUs, not code: floating-point sums in another order (another kernel,
another number of threads), which training then amplifies. `--write` measures it: after the values on this machine as
it is (two threads), it runs every preset again under each VARIANT (the kernels of an AVX2-only CPU, torch's scalar
kernels, one thread) and stores, per preset and step, the largest relative difference from the stored values (the
spread). The AVX2 variant is another CPU, not an approximation of one: an AVX2-only AMD EPYC's 12 x 20 values equal,
to the last bit, those of an AVX-512 EPYC run with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 (2026-11-28).
A value may move by `allowed`: ten times its spread, and at least 1e-5 at step 1, ten times more each step, 1 (a
relative difference of 100%: a NaN, a sign, a loss off by a factor) from step 6 on. Most presets stay within 1e-5 of
each other for several steps; SimSiam's loss, a cosine near 0 at this batch, moves 1e-4 to 1e-2 of its floor at steps
2-4 between kernels, and its spread lets it. What the comparison catches is therefore what moves the first steps: a
loss, an augmentation, the data's order or the sampler's, an initialisation, the first learning rates; a change that
shows only later needs the other tests. A 1% change of SimCLR's temperature fails at step 1 (tests/test_golden_losses.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "losses.json"
STEPS = 20
RTOL_STEP_1 = 1e-5       # the least tolerance at step 1, times 10 a step (`allowed`)
SPREAD_MARGIN = 10       # a value may move ten times its spread between kernels (`allowed`)
FLOOR = 0.1              # relative to at least this (values near 0)
# What `--write` runs besides this machine as it is, each preset's spread being the largest difference over them:
# (environment, overrides). Capping ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA reproduces a CPU with fewer instructions.
VARIANTS = {"AVX2 kernels": ({"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}, []),
            "scalar kernels": ({"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"}, []),
            "one thread": ({}, ["engine.threads=1"])}
# (name, config, overrides): every digits preset; those the demo and the docs run with selection, with it too.
PRESETS = [(name, f"configs/pretrain/{config}.yaml", overrides) for name, config, overrides in [
    ("simclr", "simclr_digits", []), ("simclr_hvs", "simclr_digits", ["hvs.enabled=true"]),
    ("simsiam", "simsiam_digits", []), ("dino", "dino_digits", []), ("dino_hvs", "dino_digits", ["hvs.enabled=true"]),
    ("supcon", "supcon_digits", []), ("tcl", "tcl_digits", []), ("tcl_supervised", "tcl_supervised_digits", []),
    ("smoco", "smoco_digits", []), ("weighted_contrastive", "weighted_contrastive_digits", []),
    ("contrastive_balance", "contrastive_balance_digits", []), ("lejepa", "lejepa_digits", [])]]
COMMON = [f"engine.max_steps={STEPS}", "engine.log_every_steps=1", "engine.image_grid_every_steps=0",
          "engine.checkpoint_every_steps=0", "data.num_workers=1"]
# s-MoCo's batch is classes x images per class (20): kept; the weighted loss's (16, n)-group design needs n >= 2.
SMALL_BATCH = {"smoco": [], "weighted_contrastive": ["data.batch_size=32"]}
RECORDED = ("train/loss", "hvs/selected_loss", "hvs/selected_iou")


def command(name: str, config: str, overrides: list[str], digits: Path, run_dir: Path) -> list[str]:
    """The preset's command line (argv of `python -m pretrain`)."""
    batch = SMALL_BATCH.get(name, ["data.batch_size=16"])
    return ["--config", str(ROOT / config), f"run_dir={run_dir}", f"data.train={digits / 'train.beton'}",
            f"data.val={digits / 'val.beton'}", *COMMON, *batch, *overrides]


def recorded(run_dir: Path, steps: int = STEPS) -> dict[str, list[float]]:
    """The stored values of a finished run: per recorded scalar, its value at steps 1..`steps`."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if [line["step"] for line in lines] != list(range(1, steps + 1)):
        raise ValueError(f"{run_dir}: expected steps 1-{steps} logged, got {[line['step'] for line in lines]}")
    return {key: [line[key] for line in lines] for key in RECORDED if key in lines[0]}


def relative_differences(a: dict[str, list[float]], b: dict[str, list[float]]) -> list[float]:
    """Per step of `a` (the first steps of `b`'s), the largest |a - b| / max(|b|, FLOOR) over the recorded values (inf
    where the two record different things). FLOOR keeps values near 0 (SimSiam's loss, a negative cosine near -0.01 at
    first) from inflating it."""
    steps = len(next(iter(a.values())))
    if a.keys() != b.keys():
        return [math.inf] * steps
    return [max(abs(x[step] - y[step]) / max(abs(y[step]), FLOOR) for x, y in ((a[key], b[key]) for key in a))
            for step in range(steps)]


def allowed(step: int, spread: float = 0.0) -> float:
    """The relative tolerance at step `step` (1-based) of a value whose kernels differ by `spread` there: ten times
    that, and at least RTOL_STEP_1 times 10 a step, 1 from step 6 on."""
    return max(min(1.0, RTOL_STEP_1 * 10 ** (step - 1)), SPREAD_MARGIN * spread)


def moved_steps(now: dict[str, list[float]], stored: dict[str, list[float]], spread: list[float]) -> list[int]:
    """The steps (1-based) whose values differ from the stored ones by more than `allowed` (given the preset's
    stored spread per step)."""
    return [step for step, difference in enumerate(relative_differences(now, stored), start=1)
            if difference > allowed(step, spread[step - 1])]


def run_presets(digits: Path, work: Path, extra: list[str] = (), env: dict[str, str] | None = None
                ) -> dict[str, dict[str, list[float]]]:
    """Every preset's recorded values, each run as `python -m pretrain` in a process of its own (with `env` added to
    this one's environment)."""
    values = {}
    for name, config, overrides in PRESETS:
        run_dir = work / name
        subprocess.run([sys.executable, "-m", "pretrain", *command(name, config, overrides, digits, run_dir), *extra],
                       check=True, capture_output=True, cwd=ROOT, env={**os.environ, **(env or {})})
        values[name] = recorded(run_dir)
        print(f"{name}: step 1 loss {values[name]['train/loss'][0]:.6f}, step {STEPS} "
              f"{values[name]['train/loss'][-1]:.6f}", flush=True)
    return values


def print_per_step(columns: dict[str, list[list[float]]], spreads: list[list[float]]) -> None:
    """Per step: for each column, the largest of its presets' relative differences; then the range of the presets'
    tolerances there (`allowed`, from their spreads)."""
    print(f"step  {'  '.join(f'{name:>14}' for name in columns)}  tolerance (least-most over the presets)")
    for step in range(1, STEPS + 1):
        largest = "  ".join(f"{max(d[step - 1] for d in rows):>14.1e}" for rows in columns.values())
        tolerances = [allowed(step, spread[step - 1]) for spread in spreads]
        print(f"{step:>4}  {largest}  {min(tolerances):.0e}-{max(tolerances):.0e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.golden_losses", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true",
                        help=f"store this machine's values in {GOLDEN.relative_to(ROOT)}, with their spread over the "
                             f"variants ({', '.join(VARIANTS)}): about 4 times the plain run")
    args = parser.parse_args(argv)
    from pretrain.data.__main__ import main as data_main

    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {"presets": {}, "spread": {}}
    with tempfile.TemporaryDirectory() as work:
        digits = Path(work) / "digits"
        data_main(["write-digits", "--out-dir", str(digits)])
        values = run_presets(digits, Path(work) / "runs")
        variants = {}
        if args.write:
            for variant, (env, extra) in VARIANTS.items():
                print(f"-- {variant}", flush=True)
                variants[variant] = run_presets(digits, Path(work) / variant.replace(" ", "_"), extra, env)
    if not args.write:
        stored, spread = golden["presets"], golden["spread"]
        for name, now in values.items():
            moved = moved_steps(now, stored[name], spread[name]) if name in stored else ["all (not stored)"]
            print(f"{name:<22} steps past the tolerance: {', '.join(map(str, moved)) or 'none'}")
        names = [name for name in values if name in stored]
        print("per step, the largest relative difference from the stored values over the presets:")
        print_per_step({"now": [relative_differences(values[name], stored[name]) for name in names]},
                       [spread[name] for name in names])
        return 0
    differences = {variant: {name: relative_differences(runs[name], values[name]) for name in values}
                   for variant, runs in variants.items()}
    spread = {name: [max(differences[variant][name][step] for variant in variants) for step in range(STEPS)]
              for name in values}
    print("per step, the largest relative difference from this machine's values over the presets, by variant:")
    print_per_step({variant: list(by_name.values()) for variant, by_name in differences.items()}, list(spread.values()))
    from pretrain.runtime.bf16_support import cpu_description
    from pretrain.runtime.provenance import read_code_state

    code = read_code_state()
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({"steps": STEPS, "written_at_commit": code.commit, "uncommitted_changes": code.dirty,
                                  "written_on": cpu_description(), "variants": VARIANTS, "presets": values,
                                  "spread": spread}, indent=1) + "\n")
    print(f"wrote {GOLDEN}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
