"""Resuming at zero tolerance: a run killed in the middle of an epoch (SIGKILL: no clean shutdown, no last checkpoint)
and resumed ends with every value the uninterrupted run ends with, to the last bit, on the same machine.

Each case (CASES) is a method on the digits at a ZeRO stage and a number of processes; together they cover every
method with state of its own, selection, and each ZeRO stage on one process and on two. The uninterrupted run trains
STEPS steps, a checkpoint every EVERY; a second run of the same command, without the step limit, is killed once it
has logged a step after its first checkpoint (what it logged after its last checkpoint is the resumed run's to
drop), then rerun with the limit. Compared with no tolerance (tests/run_helpers.py: `final_state`, `differences`):
every tensor and value of the last checkpoint (the model, the optimizer's state and each ZeRO shard of it, the
method's state outside the engine: DINO's teacher, centre and step counter, s-MoCo's key encoder and queue, the
online probe), its trainer_state.json, the exported backbone and every logged value of every step, all but the
clock's and the run's folder (NOT_COMPARED). No case needed a tolerance: all are bit-identical, bf16 (DINO under
ZeRO-2 on two processes) as fp32 (two processes are compared with two).

Every case trains the small ResNet (tests/engine_helpers.py: SMALL_RESNET, BatchNorm buffers and all): what is
resumed is the state around the backbone, and the presets' ResNet-18 made each case's three runs write and compare
about 0.5 GB of checkpoints (the file's 15 tests took 246 s of the suite's 1,414 on the AVX-512 EPYC, 2026-12-07).

The second test shows the comparison is no formality: the same resume from a copy of the uninterrupted run's first
checkpoint with one piece of state left out (reset to what a fresh start has; DINO's teacher and s-MoCo's key encoder
re-made from the student, as a start makes them) ends elsewhere, while the control, the copy with nothing left out,
ends equal. The augmentations have no state of their own to leave out: each batch's are drawn from a generator
seeded with (seed, epoch, batch) (pretrain/data/loader.py), so they follow the data position: the `position` case.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import wait_for
from tests.engine_helpers import SMALL_RESNET
from tests.golden_losses import SMALL_BATCH
from tests.run_helpers import ROOT, differences, final_state, kill_process_tree, logged, run, start

STEPS, EVERY = 8, 3
# (id, preset, overrides, ZeRO stage, processes): every method with state of its own, selection, each ZeRO stage on
# one process and on two, bf16 once; a preset's batch as the golden losses' (16 a process; s-MoCo's 20, its group's)
CASES = [("simclr", "simclr_digits", [], 0, 1),
         ("dino", "dino_digits", [], 0, 1),
         ("smoco", "smoco_digits", [], 0, 1),
         ("simsiam_zero2", "simsiam_digits", [], 2, 1),
         ("dino_zero3", "dino_digits", [], 3, 1),
         ("tcl_2proc", "tcl_digits", [], 0, 2),
         ("smoco_zero2_2proc", "smoco_digits", [], 2, 2),
         ("simclr_hvs_zero3_2proc", "simclr_digits", ["hvs.enabled=true"], 3, 2),
         ("dino_bf16_zero2_2proc", "dino_digits", ["engine.precision=bf16"], 2, 2)]


def command(case: tuple, digits: Path, run_dir: Path, *extra: str) -> list[str]:
    name, preset, overrides, zero, processes = case
    batch = SMALL_BATCH.get(name.split("_")[0], ["data.batch_size=16"])
    launcher = ["-m", "pretrain"] if processes == 1 else \
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes), "-m", "pretrain"]
    return [sys.executable, *launcher, "--config", str(ROOT / f"configs/pretrain/{preset}.yaml"), f"run_dir={run_dir}",
            f"data.train={digits / 'train.beton'}", f"data.val={digits / 'val.beton'}", "data.num_workers=1",
            "engine.log_every_steps=1", "engine.image_grid_every_steps=0", f"engine.checkpoint_every_steps={EVERY}",
            "engine.keep_checkpoints=0", f"engine.zero_stage={zero}", *SMALL_RESNET, *batch, *overrides, *extra]


_straight_runs: dict[str, Path] = {}


def straight_run(case: tuple, digits: Path, tmp_path_factory) -> Path:
    """The case's uninterrupted run of STEPS steps (made once a session: both tests read it)."""
    if case[0] not in _straight_runs:
        run_dir = tmp_path_factory.mktemp(f"straight_{case[0]}") / "run"
        run(command(case, digits, run_dir, f"engine.max_steps={STEPS}"))
        _straight_runs[case[0]] = run_dir
    return _straight_runs[case[0]]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_a_run_killed_mid_epoch_resumes_to_every_value_of_the_uninterrupted_one(case, digits, tmp_path,
                                                                               tmp_path_factory):
    straight = straight_run(case, digits, tmp_path_factory)
    killed = tmp_path / "run"
    first = start(command(case, digits, killed))          # no step limit: it is still training when killed
    latest, metrics = killed / "checkpoints" / "latest", killed / "metrics.jsonl"

    def trained_past_a_checkpoint() -> bool:
        return latest.exists() and len(metrics.read_text().splitlines()) > EVERY

    wait_for(trained_past_a_checkpoint, first, "a step logged after the first checkpoint")
    kill_process_tree(*first.pids)
    first.wait(60)
    killed_at = int(latest.read_text().strip().removeprefix("step"))
    assert 0 < killed_at < STEPS and logged(killed)[-1]["step"] > killed_at     # it had trained past its checkpoint
    position = json.loads((killed / "checkpoints" / latest.read_text().strip() / "trainer_state.json").read_text())
    assert position["batch_in_epoch"] > 0                                      # in the middle of an epoch

    resumed = run(command(case, digits, killed, f"engine.max_steps={STEPS}"))
    assert f"at step {killed_at} " in resumed.stdout
    assert differences(final_state(killed, STEPS), final_state(straight, STEPS)) == []


def copy_of_the_student(piece: str):
    """An EMA copy of the student (DINO's teacher, s-MoCo's key encoder) re-made from the student, as a start makes
    it."""
    def reset(checkpoint: Path, trainer_state: dict) -> None:
        state = torch.load(checkpoint / "mp_rank_00_model_states.pt", weights_only=False)
        copy = state["task"][piece]
        student = state["module"]
        assert set(copy) <= set(student), sorted(set(copy) - set(student))[:5]
        state["task"][piece] = {name: student[name].clone() for name in copy}
        torch.save(state, checkpoint / "mp_rank_00_model_states.pt")
    return reset


def reset_task_state(**fresh):
    """A piece of the method's state outside the engine (the checkpoint's client state) reset to its fresh value."""
    def reset(checkpoint: Path, trainer_state: dict) -> None:
        state = torch.load(checkpoint / "mp_rank_00_model_states.pt", weights_only=False)
        for name, make in fresh.items():
            state["task"][name] = make(state["task"][name])
        torch.save(state, checkpoint / "mp_rank_00_model_states.pt")
    return reset


def reset_position(checkpoint: Path, trainer_state: dict) -> None:
    """The data position (and with it the augmentations' seeds) back at the epoch's start."""
    trainer_state["batch_in_epoch"] = 0


def nothing(checkpoint: Path, trainer_state: dict) -> None:
    """The control: the copied checkpoint as it is."""


LEFT_OUT = {"nothing (the control)": ("dino", nothing),
            "dino teacher": ("dino", copy_of_the_student("teacher")),
            "dino centre": ("dino", reset_task_state(center=torch.zeros_like)),
            "smoco queue": ("smoco", reset_task_state(queue=torch.zeros_like, queue_next=lambda _: 0,
                                                      queue_filled=lambda _: 0)),
            "smoco key encoder": ("smoco", copy_of_the_student("key_encoder")),
            "position": ("simclr", reset_position)}


@pytest.mark.slow
@pytest.mark.parametrize("piece", LEFT_OUT)
def test_a_resume_without_one_piece_of_state_ends_elsewhere(piece, digits, tmp_path, tmp_path_factory):
    name, leave_out = LEFT_OUT[piece]
    case = next(case for case in CASES if case[0] == name)
    straight = straight_run(case, digits, tmp_path_factory)
    run_dir = tmp_path / "run"             # the uninterrupted run as it was at its first checkpoint, but the piece
    shutil.copytree(straight, run_dir)
    (run_dir / "finished.json").unlink()
    for later in (run_dir / "checkpoints").glob("step*"):
        if later.name != f"step{EVERY:08d}":
            shutil.rmtree(later)
    checkpoint = run_dir / "checkpoints" / f"step{EVERY:08d}"
    (run_dir / "checkpoints" / "latest").write_text(checkpoint.name)
    trainer_state = json.loads((checkpoint / "trainer_state.json").read_text())
    leave_out(checkpoint, trainer_state)
    (checkpoint / "trainer_state.json").write_text(json.dumps(trainer_state))

    resumed = run(command(case, digits, run_dir, f"engine.max_steps={STEPS}"))
    assert f"at step {EVERY} " in resumed.stdout
    found = differences(final_state(run_dir, STEPS), final_state(straight, STEPS))
    assert (found == []) if leave_out is nothing else (found != [])
