"""The reads a training step makes from the device: none on a step that neither logs nor checkpoints on one process,
the stop check's one all-reduce on two; a NaN loss on such a step is still caught, at the next step that reads.

Counted by pretrain/runtime/device_reads.py (`.item()`, `.tolist()`, `.cpu()`, `bool()` / `float()` of a tensor, ...,
patched for the run), on the real loop (`pretrain.bench.train.project_step_seconds`: run_training with the real
Pretraining stage on a fixed batch). Before the loop noted the losses on the device (pretrain/runtime/divergence.py:
NonFiniteLosses), every step read at least once (the finite-loss check), SimCLR's three times (the online probe's
Adam step counter too, a host value no longer counted), DINO's 2 more (its clipping's scales, its centre's row count),
TCL's 11 (each candidate's |z| check), s-MoCo's 7 (each batch's labels)."""
from __future__ import annotations

import pytest

from pretrain.bench.train import case_config, case_in_a_process, project_step_seconds
from pretrain.runtime.device_reads import DeviceReads
from tests.run_helpers import ROOT, run
from tests.test_pretrain_run import pretrain_command

LOG_EVERY, STEPS = 3, 7
QUIET_STEPS = (1, 2, 4, 5)          # neither log (3, 6) nor checkpoint (the last, 7, also the epoch's end)
CASES = [("simclr_digits.yaml", ["hvs.enabled=true"]), ("simsiam_digits.yaml", []),
         ("dino_digits.yaml", ["hvs.enabled=true"]), ("tcl_supervised_digits.yaml", ["hvs.enabled=true"]),
         ("smoco_digits.yaml", []), ("lejepa_digits.yaml", [])]
# The methods that need class labels check the first batch's (pretrain/methods/base.py: refuse_unknown_labels).
LABEL_CHECK = {"tcl_supervised_digits.yaml": {"pretrain/methods/base.py __bool__": 1},
               "smoco_digits.yaml": {"pretrain/methods/base.py __bool__": 1}}


def sites(counter) -> dict[str, int]:
    """A step's reads by file and call, the line numbers left out."""
    by_file: dict[str, int] = {}
    for site, count in counter.items():
        where, call = site.split()
        key = f"{where.split(':')[0]} {call}"
        by_file[key] = by_file.get(key, 0) + count
    return by_file


@pytest.mark.parametrize("config, overrides", CASES, ids=[c[0].removesuffix("_digits.yaml") for c in CASES])
def test_a_step_that_neither_logs_nor_checkpoints_reads_nothing_on_one_process(config, overrides, digits, tmp_path):
    cfg = case_config(str(ROOT / "configs/pretrain" / config),
                      ["data.batch_size=8", f"engine.log_every_steps={LOG_EVERY}", *overrides], tmp_path / "run", STEPS,
                      digits)
    reads = DeviceReads()
    project_step_seconds(cfg, STEPS, reads=reads)
    assert len(reads.reads) == STEPS + 1
    quiet = {step: sites(reads.reads[step]) for step in QUIET_STEPS}
    assert quiet == {step: LABEL_CHECK.get(config, {}) if step == 1 else {} for step in QUIET_STEPS}
    # The count sees reads: the steps that log read their values (and the last saves a checkpoint).
    assert all(reads.per_step()[step] > 0 for step in (3, 6, 7))


def test_on_two_processes_a_quiet_step_reads_once_for_the_stop_check(digits):
    """Two processes must stop after the same step (a signal on one, the time budget): one all-reduce of the
    signal and the training clock every step (pretrain/runtime/graceful_stop.py: agree), read back on every step.
    Every step rather than every K: a signal or the budget then ends the run at the step it came, as on one process."""
    case = {"config": str(ROOT / "configs/pretrain/simclr_digits.yaml"), "plain": False, "count_reads": True,
            "overrides": ["data.batch_size=8", f"engine.log_every_steps={LOG_EVERY}"], "steps": STEPS,
            "data": str(digits)}
    result = case_in_a_process(case, processes=2)
    quiet = {step: sites(result["read_sites"][step]) for step in QUIET_STEPS}
    assert quiet == {step: {"pretrain/runtime/graceful_stop.py tolist": 1} for step in QUIET_STEPS}


@pytest.mark.slow
def test_a_nan_loss_on_a_step_that_reads_nothing_stops_the_run_at_the_next_step_that_reads(digits, tmp_path):
    """At lr 1e20 the second step's loss is NaN (tests/test_pretrain_run.py: the divergence test, where every step
    logs and the step is not applied). Logging every 4 steps, steps 1-3 read nothing: the NaN of step 2 is noted on
    the device and found before step 4; steps 2 and 3 were applied, and nothing of them is logged or saved."""
    run_dir = tmp_path / "run"
    failed = run(pretrain_command(run_dir, digits, "optim.lr=1e20", "optim.warmup_epochs=0", "engine.log_every_steps=4",
                                  "engine.checkpoint_every_steps=0", "engine.max_steps=8",
                                  "engine.image_grid_every_steps=0"), expect=1)
    assert ("training diverged in epoch 0: the loss is nan in step 2, found after step 3: steps 2 to 3 were applied, "
            "and none of them was saved") in failed.stderr
    assert "No checkpoint had been saved yet" in failed.stderr
    assert not list((run_dir / "checkpoints").glob("step*")) and not (run_dir / "finished.json").exists()
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip()
