"""The GPU-only tests (`make gpu-check`): they need CUDA and say so at once where there is none."""
import pytest
import torch


def pytest_sessionstart(session):
    if not torch.cuda.is_available() and not session.config.option.collectonly:   # collecting: gpu-check --dry-run
        pytest.exit("tests/gpu need a CUDA GPU: torch.cuda.is_available() is False on this machine. Run `make "
                    "gpu-check` on a machine with one (the CPU tests are `make test`).", returncode=2)
