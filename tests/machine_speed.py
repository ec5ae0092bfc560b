"""How much slower this machine is than the CPU the suite was tuned on: one factor, measured once per test run, by
which every timeout and wait of the suite is scaled (`scaled(seconds)`), so that no test passes or fails by the
CPU's speed alone.

The measure is a short reference step (pretrain/bench/precision.py: ReferenceStep): one training step (forward,
backward, SGD) of the project's ResNet-18 with its stride-2 stem on a batch of 256 16-px images, fp32, torch's
default threads, the median of 3 after one warm-up.
On the CPU the suite was tuned on (AMD EPYC with AVX-512 and AVX-512 BF16, 2 cores, idle) the same step ran at 747
images/s (../shared/ENVIRONMENT.md, "Threads on a shared CPU"): REFERENCE_STEP_S. The factor is the measured median
over that, and never below 1 (a faster machine keeps the tuned waits).

`make test` measures once (`python -m tests.machine_speed` prints the factor) and hands it to both of its pytests in
HARDVIEW_TEST_SLOWNESS; a pytest started without it measures as it collects (its last line prints the factor).
Setting it by hand (HARDVIEW_TEST_SLOWNESS=3 pytest ...) replaces the measurement.
"""
from __future__ import annotations

import os
import statistics

REFERENCE_STEP_S = 256 / 747
ENV = "HARDVIEW_TEST_SLOWNESS"

_slowness: float | None = None


def reference_step_seconds(rounds: int = 3) -> float:
    """The median time of the reference step here (see the module docstring), after one warm-up step."""
    from pretrain.bench.precision import ReferenceStep

    step = ReferenceStep(batch=256, side=16)
    step.seconds()
    return statistics.median(step.seconds() for _ in range(rounds))


def slowness() -> float:
    """This machine's factor: HARDVIEW_TEST_SLOWNESS when set, else measured once in this process."""
    global _slowness
    if _slowness is None:
        given = os.environ.get(ENV)
        if given:
            try:
                _slowness = float(given)
            except ValueError:
                raise ValueError(f"{ENV}={given!r} is not a number: give the factor (e.g. 2.5), or unset it to "
                                 "measure it") from None
            if _slowness <= 0:
                raise ValueError(f"{ENV}={given!r}: the factor must be positive")
        else:
            _slowness = max(1.0, reference_step_seconds() / REFERENCE_STEP_S)
    return _slowness


def scaled(seconds: float) -> float:
    """`seconds` as tuned on the reference CPU, scaled to this machine."""
    return seconds * slowness()


if __name__ == "__main__":
    import pretrain  # noqa: F401  (the OpenMP wait policy every command and test process gets)

    print(f"{slowness():.2f}")
