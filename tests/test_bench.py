"""The benchmark commands of the README run, tiny: their tables print and their JSON is written (their
numbers are measured by running them, never asserted here)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_bench_commands_run_and_write_their_tables(tmp_path):
    loader = subprocess.run([sys.executable, "-m", "pretrain.bench", "loader", "--images", "64", "--batch-size", "16",
                             "--workers", "1", "--epochs", "1", "--views", "2", "--data-dir", str(tmp_path / "data"),
                             "--out", str(tmp_path / "loader.json")], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert loader.returncode == 0, loader.stderr[-3000:]
    assert json.loads((tmp_path / "loader.json").read_text())
    hvs = subprocess.run([sys.executable, "-m", "pretrain.bench", "hvs", "--batch-size", "8", "--steps", "1",
                          "--warmup", "1", "--out", str(tmp_path / "hvs.json")], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert hvs.returncode == 0, hvs.stderr[-3000:]
    assert json.loads((tmp_path / "hvs.json").read_text())
