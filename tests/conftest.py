"""Shared fixtures and helpers of the suite.

- `digits` / `digits_dml`: the embedded digits written once per session, as `python -m pretrain.data
  write-digits [--split-classes]` writes them; read-only (tests write their runs under tmp_path). `few_digits`: a
  quarter of them, for tests of mechanics.
- `free_port`: a free TCP port for a test's own process group.
- `wait_for(condition, process, ...)`: poll until a condition holds while a started run is still running.

Markers (registered in pyproject.toml): `slow` (whole runs through the command line, multi-process runs,
anything over about 5 s) and `slurm` (starts a real Slurm cluster: tests/slurm_cluster.py).
`make test-fast` runs `pytest -m "not slow and not slurm"`; `make test` runs everything.

The modules of RUN_LAST run after the others (`pytest_collection_modifyitems`).
"""
import os
import time
from pathlib import Path

import pytest

# The suite's own processes (the pytest workers, whose tests step models in-process) get the OpenMP wait policy the
# commands get: pretrain sets it before torch loads, and a test module that imports torch first would load it with
# libgomp's default spin, which spends a taken core waiting beside the other worker (pretrain/__init__.py).
import pretrain  # noqa: F401,E402
from tests import forked_runs  # noqa: E402
from tests.machine_speed import ENV, scaled, slowness  # noqa: E402

# The forkserver is one per process, started by its first user with the modules asked for by then: the forked runs'
# (the whole pipeline) are asked for now, before an in-process run's DataLoader workers (which add theirs) start it.
forked_runs.context()


# Modules whose tests run processes that wait for each other at every collective (gloo), or that step several
# models side by side. `make test` runs the real-Slurm tests beside the others for their first 7 minutes or so;
# a rank descheduled by them holds up its partner at each collective, so these ran up to 1.4x their time alone
# there (the distributed-equality fixture 88 s against 63). Run last, they meet the Slurm jobs less.
RUN_LAST = {"test_checkpoint", "test_dino_runs", "test_distributed_equality", "test_engine_step", "test_gradient_edits",
            "test_smoco"}


# Every test's deadline (pytest-timeout), fixtures included, in seconds on the reference CPU (tests/machine_speed.py):
# several times the longest test there (the benchmark's end-to-end test, about 90 s; the Slurm test of every kind of
# job, about 400 s). A test still running then has hung: pytest-timeout prints every thread's stack and ends the
# session ("thread": it also ends a wait inside C code, such as a deadlocked lock, which "signal" cannot interrupt).
TEST_DEADLINE_S = 600
SLURM_TEST_DEADLINE_S = 1500


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.module.__name__.rsplit(".", 1)[-1] in RUN_LAST)      # stable: order kept
    for item in items:
        if item.get_closest_marker("timeout") is None:
            deadline = SLURM_TEST_DEADLINE_S if item.get_closest_marker("slurm") else TEST_DEADLINE_S
            item.add_marker(pytest.mark.timeout(scaled(deadline), method="thread"))


def pytest_collection_finish(session):
    """Everything the test modules imported (torch, DeepSpeed, timm, FFCV: about 400,000 objects) out of the garbage
    collector's scans: the in-process tests' DeepSpeed engines collect explicitly at every start and checkpoint, and
    each full collection scanned them all (0.3 s on an AVX2-only EPYC; 3.7 s of the 99 s of test_dino.py and
    test_gradient_edits.py)."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"waits and deadlines scaled by {slowness():.2f} (this machine against the suite's "
                                f"reference CPU; {ENV} sets it: tests/machine_speed.py)")


def write_digits_with_the_cli(out_dir: Path, *args: str) -> Path:
    """OUT_DIR with the digits written by `python -m pretrain.data write-digits --out-dir OUT_DIR ARGS`."""
    from pretrain.data.__main__ import main

    assert main(["write-digits", "--out-dir", str(out_dir), *args]) == 0
    return out_dir


@pytest.fixture(scope="session")
def digits(tmp_path_factory) -> Path:
    """The digits' folder: train.beton and val.beton (stratified 80/20, seed 0), written once per session."""
    return write_digits_with_the_cli(tmp_path_factory.mktemp("digits"))


@pytest.fixture(scope="session")
def few_digits(tmp_path_factory) -> Path:
    """Every 4th image of each of the digits' splits (360 train / 90 val), written as `digits` is: for the tests of a
    command's mechanics (jobs, watchers, resumes), whose every evaluation costs a quarter on these."""
    import json

    from pretrain.data.digits import digits_images, digits_split
    from pretrain.data.writer import ArrayImageSet, classes_path, write_beton

    out_dir = tmp_path_factory.mktemp("few_digits")
    images, labels = digits_images()
    for split, rows in zip(("train", "val"), digits_split(labels)):
        rows = rows[::4]
        write_beton(out_dir / f"{split}.beton", ArrayImageSet(lambda i, rows=rows: images[rows[i]],
                                                              labels[rows].tolist(), None), write_mode="jpg")
        classes_path(out_dir / f"{split}.beton").write_text(json.dumps([str(digit) for digit in range(10)]))
    return out_dir


@pytest.fixture(scope="session")
def digits_dml(tmp_path_factory) -> Path:
    """The digits' DML split: train.beton (every image of the digits 0-4) and test.beton (5-9), once per session."""
    return write_digits_with_the_cli(tmp_path_factory.mktemp("digits_dml"), "--split-classes")


@pytest.fixture
def free_port() -> int:
    """A free TCP port on localhost for a test's own process group."""
    return forked_runs.free_port()


def wait_for(condition, process, what: str = "the awaited condition", timeout: float = 240,
             interval: float = 0.05) -> None:
    """Poll `condition()` every `interval` s until it holds. Fails (AssertionError) at once when `process` (a
    tests.forked_runs.ForkedRun or a subprocess.Popen) ends first, with the end of its stderr, and after
    `timeout` s on the reference CPU (scaled to this machine: tests/machine_speed.py)."""
    deadline = time.time() + scaled(timeout)
    while not condition():
        if process.poll() is not None:
            stderr = process.stderr if isinstance(process.stderr, str) else \
                process.stderr.read().decode() if process.stderr is not None else ""
            raise AssertionError(f"the run ended with {process.poll()} while waiting for {what}: {stderr[-3000:]}")
        assert time.time() < deadline, \
            f"timed out after {scaled(timeout):.0f} s waiting for {what} (the run is pid {process.pid})"
        time.sleep(interval)


# tests/gpu needs CUDA: `make gpu-check` runs it (HARDVIEW_GPU_TESTS=1); `make test` leaves it out.
collect_ignore_glob = [] if os.environ.get("HARDVIEW_GPU_TESTS") else ["gpu/*"]
