"""The benchmark commands of the README run, tiny: their tables print and their JSON is written (their
numbers are measured by running them, never asserted here)."""
import json
from pathlib import Path

import pytest

from tests import forked_runs

pytestmark = pytest.mark.slow          # every benchmark command, tiny

ROOT = Path(__file__).parents[1]


def test_bench_commands_run_and_write_their_tables(tmp_path):
    # `python -m pretrain.bench ...`, forked from a server that imported torch (tests/forked_runs.py)
    forked_runs.run("pretrain.bench", ["loader", "--images", "64", "--batch-size", "16", "--workers", "1", "--epochs",
                                       "1", "--views", "2", "--data-dir", tmp_path / "data", "--out",
                                       tmp_path / "loader.json"])
    assert json.loads((tmp_path / "loader.json").read_text())
    forked_runs.run("pretrain.bench", ["hvs", "--batch-size", "8", "--steps", "1", "--warmup", "1", "--out",
                                       tmp_path / "hvs.json"])
    assert json.loads((tmp_path / "hvs.json").read_text())
