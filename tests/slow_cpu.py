"""Run a command on a slower CPU than this one: a busy loop pinned to each core at a higher priority takes a fixed
share of every core, so each thread of the command runs about as fast as on a CPU that much slower, wherever it runs.

    python -m tests.slow_cpu [--nice -3] -- make test
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python -m tests.slow_cpu -- make test    # an AVX2-only CPU

Why: capping torch's instruction sets (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2) on an AVX-512 EPYC gives
the AVX2-only EPYC's kernels, numbers and emulated bf16, but not its speed: tests/machine_speed.py measured 1.9-2.2
there against 4.8-7.2 on the AVX2-only EPYC itself, whose fp32 steps and interpreter starts were about 3x slower.
With the busy loops at nice -3 (weight 1,991 against a nice-0 thread's 1,024: one thread of the command on a core
gets about a third of it, 1,024 / 3,015; two on one core share about half, 2,048 / 4,039, so a busy phase is slowed
less than a lightly loaded one, unlike on a slower CPU) the capped AVX-512 EPYC measured 6.49-7.82 over eight
readings, at nice -2 5.62 (docs/tests.md, "A slow CPU on a fast one" and the afternoon's correction: the suite's wall
under the model was 2.52x the native one, 2.75x on the AVX2-only EPYC). Unlike a CPU quota (cgroups' cpu.max), the
share is per core, not per process group: a single-threaded start-up and a 2-process run (a process a core) are
slowed alike, as on a slower CPU.

Needs root: a negative nice, and the scheduler's autogroups off for the run (with them on, each session's threads
share one weight, and the loops' nice would not count against the command's); both are restored at the end. Where
the command's threads sleep, the loops run: waits, timers and the scheduler's clock are not slowed, as on a slower
CPU.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled")


def busy_loop(core: int, nice: int) -> subprocess.Popen:
    """A Python busy loop pinned to `core` at `nice`."""
    def pin_and_renice() -> None:
        os.sched_setaffinity(0, {core})
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin_and_renice)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.slow_cpu", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nice", type=int, default=-3,
                        help="the busy loops' nice (default -3: the command keeps about a third of each core; "
                             "-2 about 0.39, -5 about 0.25)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --, e.g. python -m tests.slow_cpu -- make test")
    if os.geteuid() != 0:
        parser.error("needs root (a negative nice, and /proc/sys/kernel/sched_autogroup_enabled set to 0 for the run)")
    autogroup = AUTOGROUP.read_text().strip() if AUTOGROUP.exists() else None
    if autogroup is not None:
        AUTOGROUP.write_text("0")
    loops = [busy_loop(core, args.nice) for core in sorted(os.sched_getaffinity(0))]
    print(f"== slow_cpu: {len(loops)} busy loops at nice {args.nice}, one a core; running {' '.join(command)}",
          flush=True)
    try:
        return subprocess.run(command).returncode
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
        if autogroup is not None:
            AUTOGROUP.write_text(autogroup)


if __name__ == "__main__":
    sys.exit(main())
