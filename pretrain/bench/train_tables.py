"""The tables `python -m pretrain.bench train` prints from its result (pretrain/bench/train.py)."""
from __future__ import annotations

from pretrain.bench.machine import machine_heading


def print_tables(result: dict) -> None:
    overrides = f"; every table with {' '.join(result['overrides'])}" if result["overrides"] else ""
    print(f"\nthe pretraining step against a plain PyTorch loop of the same model "
          f"({machine_heading(result['machine'])}; a run's images/s: the median of {result['steps']} steps after "
          f"{result['warmup']}; {result['rounds']} alternating rounds, each side in a process of its own; plain / "
          f"project per round{overrides})")
    print(f"{'case':<24}{'batch':>6}{'project images/s':>18}{'plain images/s':>16}{'plain / project':>17}"
          f"{'range':>14}{'rounds':>8}{'reads a step':>14}")
    print(f"{'':<30}{'(median)':>18}{'(median)':>16}{'(median)':>17}{'':>22}{'(quiet / log)':>14}")
    for row in result["rows"]:
        ratio, reads = row["plain_over_project"], row["reads"]
        print(f"{row['case']:<24}{row['batch']:>6}{row['project_images_per_s']['median']:>18.1f}"
              f"{row['plain_images_per_s']['median']:>16.1f}{ratio['median']:>17.3f}"
              f"{ratio['min']:>8.3f}-{ratio['max']:.3f}{len(row['rounds']):>8}"
              f"{reads['quiet_step_max']:>8} / {reads['logging_step_max']}")
    print("(reads a step: the device-to-host reads of the project's step, counted by pretrain/runtime/device_reads.py: "
          "the most of a step that neither logs nor checkpoints / of a step that logs)")
    if "plain_variants" in result:
        print(f"\nthe plain loop with a variant: images/s and variant / as it is per round, median (range) over "
              f"{result['rounds']} alternating rounds")
        for row in result["plain_variants"]:
            rate, gain = row["plain_images_per_s"], row["over_as_it_is"]
            print(f"  {row['case']:<24}{row['variant']:<16}{rate['median']:8.1f} ({rate['min']:.1f}-{rate['max']:.1f})"
                  f"  {gain['median']:.3f}x ({gain['min']:.3f}-{gain['max']:.3f})")
    if "split" not in result:
        return
    split = result["split"]
    print(f"\n{split['case']}: where a step's time goes (ms per step; the step {split['step_ms_profiled']:.1f} ms "
          f"under the profiler), and the loader's time per batch of the same recipe: {split['loader_ms_per_batch']:.1f} "
          "ms (the real FFCV loader, overlapping the step in training)")
    for phase, ms in sorted(split["phases_ms"].items(), key=lambda item: -item[1]):
        print(f"  {phase:<40}{ms:9.1f}")
    two = result["processes"]
    print(f"\n{two['case']}, global batch {two['global_batch']}: 1 process {two['one_process_images_per_s']:.1f} "
          f"images/s, 2 processes (gloo) {two['two_processes_images_per_s']:.1f} images/s")
    print("\nbeside K busy processes: images/s against the fair share (idle / (K + 1)); goal >= 0.8")
    for row in result["contention"]:
        print(f"  OpenMP {row['wait_policy']:<20} K={row['busy_processes']}: {row['images_per_s']:8.1f} images/s, "
              f"fair share {row['fair_share']:8.1f}, {row['of_fair_share']:.2f} of it")
