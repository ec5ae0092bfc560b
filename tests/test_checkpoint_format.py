"""Checkpoints across versions of the code (pretrain/runtime/checkpoint.py: CHECKPOINT_FORMAT): a checkpoint carries
its format's version; one of the versions this code reads resumes, one of another is refused in one line naming both.
tests/data/checkpoint_format_1 is a small checkpoint of format 1 (a 2-step run of the small ResNet on the digits),
kept so that every later version of the code is tested against it. It was written by

    python -m tests.test_checkpoint_format tests/data/checkpoint_format_1 DIGITS_DIR

(DIGITS_DIR: `python -m pretrain.data write-digits --out-dir DIGITS_DIR`), and is not rewritten when the format
changes: a new version keeps its own stored checkpoint beside it."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.runtime.checkpoint import CHECKPOINT_FORMAT, CheckpointError, check_layout
from tests import forked_runs
from tests.engine_helpers import SMALL_RESNET, TINY

ROOT = Path(__file__).parents[1]
STORED = ROOT / "tests/data/checkpoint_format_1"
CONFIG = ROOT / "configs/pretrain/simclr_digits.yaml"
# The stored run's settings: the small ResNet, SGD without momentum (no optimizer state to store), 2 steps.
STORED_RUN = [*TINY, *SMALL_RESNET, "optim.momentum=0", "engine.checkpoint_every_steps=2",
              "engine.image_grid_every_steps=0", "engine.keep_exports=0"]


def command(run_dir: Path, digits: Path, steps: int) -> list[str]:
    return ["--config", str(CONFIG), f"run_dir={run_dir}", f"data.train={digits / 'train.beton'}",
            f"data.val={digits / 'val.beton'}", *STORED_RUN, f"engine.max_steps={steps}"]


def test_a_checkpoint_of_a_format_this_code_reads_passes_and_one_of_another_is_refused_naming_both(tmp_path):
    """Format 0 (trainer_state.json without "format": written before the versions) and this code's pass the check;
    a newer one is refused in one line that names its version, the versions this code reads, and what to do."""
    checkpoint = tmp_path / "run/checkpoints/step00000002"
    checkpoint.mkdir(parents=True)
    layout = {"world_size": 1, "batch_size": 6}
    for version in (None, 0, CHECKPOINT_FORMAT):
        state = {"step": 2, **layout, **({} if version is None else {"format": version})}
        (checkpoint / "trainer_state.json").write_text(json.dumps(state))
        check_layout(checkpoint, layout)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"format": CHECKPOINT_FORMAT + 1, "step": 2, **layout}))
    with pytest.raises(CheckpointError) as refused:
        check_layout(checkpoint, layout)
    message = str(refused.value)
    assert f"it is in checkpoint format {CHECKPOINT_FORMAT + 1}, and this code resumes formats 0 to " \
           f"{CHECKPOINT_FORMAT}" in message and "provenance.json names the commit" in message
    assert len(message.splitlines()) == 1


@pytest.mark.slow
def test_the_stored_checkpoint_of_format_1_resumes_and_trains_on(digits, tmp_path):
    """The run of tests/data/checkpoint_format_1, copied, resumes at its step 2 with the settings it was written
    with and trains step 3; the same copy marked with a format this code does not know is refused in one line, and its
    files are left as they were."""
    assert json.loads((STORED / "checkpoints/step00000002/trainer_state.json").read_text())["format"] == 1
    run_dir = tmp_path / "run"
    shutil.copytree(STORED, run_dir)
    resumed = forked_runs.run("pretrain", command(run_dir, digits, 3))
    assert f"resumed {run_dir} at step 2 " in resumed.stdout
    assert json.loads((run_dir / "finished.json").read_text())["step"] == 3

    unknown = tmp_path / "unknown"
    shutil.copytree(STORED, unknown)
    state = unknown / "checkpoints/step00000002/trainer_state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "format": 99}))
    before = sorted(path.relative_to(unknown) for path in unknown.rglob("*"))
    refused = forked_runs.run("pretrain", command(unknown, digits, 3), expect=2)
    assert "it is in checkpoint format 99, and this code resumes formats 0 to" in refused.stderr
    assert sorted(path.relative_to(unknown) for path in unknown.rglob("*")) == before


def write_stored_checkpoint(out_dir: Path, digits: Path) -> None:
    """The run of STORED_RUN for 2 steps, its checkpoint and config kept (the rest is what a run writes anew)."""
    scratch = out_dir.with_name(out_dir.name + ".scratch")
    shutil.rmtree(scratch, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pretrain", *command(scratch, digits, 2)], check=True, cwd=ROOT)
    (scratch / "finished.json").unlink()
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    shutil.copy(scratch / "config.yaml", out_dir / "config.yaml")
    shutil.copytree(scratch / "checkpoints", out_dir / "checkpoints")
    shutil.rmtree(scratch)


if __name__ == "__main__":
    write_stored_checkpoint(Path(sys.argv[1]), Path(sys.argv[2]))
