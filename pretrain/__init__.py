"""Hardview pretraining: FFCV N-view data, methods with hard view selection, DeepSpeed ZeRO engine."""
import os

import torch

# DeepSpeed picks its accelerator when first asked; without a GPU it must be the CPU one (gloo underneath).
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
