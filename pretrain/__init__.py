"""Hardview pretraining: FFCV N-view data, methods with hard view selection, DeepSpeed ZeRO engine."""
import os

# Before torch loads its OpenMP (libgomp reads this once, at load): a thread that reaches a barrier sleeps instead of
# spinning for its partners. With the default spin, a 2-thread step beside one busy process ran at 0.69 of its fair
# share (its threads spin for a partner whose core is taken); passive, at 1.08, and no slower alone
# (docs/benchmarks.md, "Training step"). A value already set (OMP_WAIT_POLICY=active) is kept. The eval and transfer
# packages and `python -m launch` import this package first, so every command gets it (launch/__init__ imports
# nothing: a job's pickle loads fast, launch/__init__.py says why).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# ... after a short spin: libgomp's GOMP_SPINCOUNT (about 100,000 spins a millisecond) overrides the policy's count, 0
# for PASSIVE. 1000 spins (~10 us) catch the next of the step's back-to-back small parallel regions without a wake-up,
# and give a taken core back at once: SimCLR's Fashion-MNIST step 377-402 images/s alone against 359-366 with no spin,
# 1.02 of its fair share beside a busy process (10,000 spins: 0.76; 100,000: 0.39). Other OpenMP runtimes ignore it.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

import torch  # noqa: E402  (after the OpenMP setting)

# DeepSpeed picks its accelerator when first asked; without a GPU it must be the CPU one (gloo underneath).
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
