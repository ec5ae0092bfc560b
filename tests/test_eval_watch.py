"""`python -m eval watch`: every checkpoint of a running pretraining evaluated exactly once, in step order; a
watcher killed mid-evaluation and restarted adds no duplicate and leaves no gap; a partly written export is
never read; an export deleted before it was evaluated is listed as skipped."""
import json
import signal
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.machine_speed import scaled
from tests import forked_runs
from tests.conftest import wait_for
from tests.engine_helpers import SMALL_RESNET

pytestmark = pytest.mark.slow          # a whole pretraining run watched by `eval watch`

ROOT = Path(__file__).parents[1]
CONFIG = ROOT / "configs/pretrain/simclr_digits.yaml"


def test_every_checkpoint_once_in_order_across_a_killed_and_restarted_watcher(digits, tmp_path):
    run_dir = tmp_path / "run"
    # `python -m pretrain` / `python -m eval watch`, forked from a server that imported torch (tests/forked_runs.py)
    pretraining = forked_runs.start("pretrain", [
        "--config", CONFIG, f"run_dir={run_dir}", f"data.train={digits / 'train.beton'}",
        f"data.val={digits / 'val.beton'}", "data.batch_size=128", "data.num_workers=1", "model.proj_hidden_dim=64",
        "model.proj_out_dim=32", "engine.max_steps=9", "engine.checkpoint_every_steps=3",
        "engine.image_grid_every_steps=0", "engine.log_every_steps=1", *SMALL_RESNET])   # the watcher is the subject
    (run_dir / "exports").mkdir(parents=True, exist_ok=True)
    # An export being written: a temporary name, never listed in published.txt. It must never be read.
    (run_dir / "exports" / ".backbone_step00000012.pth.tmp").write_bytes(b"half a file")
    watch = ["watch", "--run", run_dir, "--protocols", "knn,linear", "--poll-seconds", "0.5", "--num-workers", "1"]
    first = forked_runs.start("eval", watch)
    wait_for(lambda: "evaluating step 6: linear" in first.stdout, first, "the linear probe of step 6", timeout=180)
    first.send_signal(signal.SIGKILL)                         # mid-evaluation: step 6's linear is not recorded
    first.wait(30)
    assert (run_dir / "eval/knn_step0000006.json").is_file()
    assert not (run_dir / "eval/linear_step0000006.json").exists()

    assert pretraining.wait(timeout=scaled(240)) == 0, pretraining.stderr[-3000:]
    # A step published but whose export is gone (rotated away by engine.keep_exports) is listed, not waited for.
    with open(run_dir / "exports/published.txt", "a") as published:
        published.write("10\n")
    second = forked_runs.run("eval", watch, timeout=240)
    assert "took over the lock of an earlier run" in second.stderr          # the killed watcher's lock
    done = [line for line in second.stdout.splitlines() if line.startswith("evaluating")]
    assert done[0] == "evaluating step 6: linear"                           # completes the interrupted one
    assert done == ["evaluating step 6: linear", "evaluating step 9: knn", "evaluating step 9: linear"]
    assert "skipped step 10: its export was deleted" in second.stdout

    for protocol in ("knn", "linear"):
        results = sorted((run_dir / "eval").glob(f"{protocol}_step*.json"))
        assert [json.loads(p.read_text())["step"] for p in results] == [3, 6, 9]
        assert all(json.loads(p.read_text())["checkpoint"].endswith(f"backbone_step{json.loads(p.read_text())['step']:08d}.pth")
                   for p in results)
    events = EventAccumulator(str(run_dir / "tb")).Reload()
    assert [e.step for e in events.Scalars("eval/knn_top1_k20")] == [3, 6, 9]        # once each, no gap
    assert [e.step for e in events.Scalars("eval/linear_top1")] == [3, 6, 9]
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 10))      # beside the training curves
    assert not list((run_dir / "eval").glob("features_step*.pt"))                     # cleaned once all ran
    assert not (run_dir / "eval" / "watch.lock").exists()
    # For the README: seconds from a checkpoint's export to its k-NN result (polling every 0.5 s).
    latency = [(run_dir / f"eval/knn_step{step:07d}.json").stat().st_mtime -
               (run_dir / f"exports/backbone_step{step:08d}.pth").stat().st_mtime for step in (3, 9)]
    print(f"export -> k-NN result: {', '.join(f'{s:.1f} s' for s in latency)} (steps 3 and 9)")


def finished_run_with_exports(run_dir: Path, digits: Path, steps: tuple[int, ...]) -> Path:
    """A finished run directory with a published random-init ResNet-18 export (on the digits) at each of `steps`,
    evaluated at 16 px by its config."""
    from pretrain.models import create_backbone
    from tests.eval_helpers import write_export

    for step in steps:
        torch.manual_seed(step)
        write_export(run_dir / f"exports/backbone_step{step:08d}.pth", create_backbone("resnet18", "small_stride2")
                     .state_dict(), train=digits / "train.beton", val=digits / "val.beton", step=step,
                     eval_image_size=16)
    (run_dir / "exports/published.txt").write_text("".join(f"{step}\n" for step in steps))
    (run_dir / "finished.json").write_text(json.dumps({"step": steps[-1], "epoch": 1}))
    return run_dir


def test_exports_rotated_away_mid_list_are_skipped_and_each_cache_is_removed_after_its_last_protocol(
        few_digits, tmp_path, capsys):
    """A run that keeps few exports deletes old ones while the watcher works through its list: the watcher re-checks
    each export (it used to crash on the first vanished one). With --protocols linear,knn the features are extracted
    once per step and removed after the step's last protocol (the cache used to be removed after the
    alphabetically last, linear, so knn extracted it again and left it behind)."""
    from eval.__main__ import build_parser
    from eval.watch import evaluate, watch

    run_dir = finished_run_with_exports(tmp_path / "run", few_digits, (3, 6, 9))
    calls = []

    def evaluate_while_the_run_rotates(argv):
        step = int(argv[argv.index("--checkpoint") + 1][-12:-4])
        calls.append((argv[0], step, (run_dir / f"eval/features_step{step:07d}.pt").is_file()))
        evaluate(argv)
        if step == 3:                                   # the run moves on and deletes step 6's export
            (run_dir / "exports/backbone_step00000006.pth").unlink(missing_ok=True)

    args = build_parser().parse_args(["watch", "--run", str(run_dir), "--protocols", "linear,knn", "--poll-seconds",
                                      "0.1", "--image-size", "16", "--num-workers", "1"])
    assert watch(args, evaluate=evaluate_while_the_run_rotates) == 0
    # (protocol, step, whether the step's features were cached when it started)
    assert capsys.readouterr().out.count("skipped step 6: its export was deleted") == 1
    assert calls == [("linear", 3, False), ("knn", 3, True), ("linear", 9, False), ("knn", 9, True)]
    assert sorted(p.name for p in (run_dir / "eval").glob("*_step*")) == [
        "knn_step0000003.json", "knn_step0000009.json", "linear_step0000003.json", "linear_step0000009.json"]


def test_a_stop_signal_mid_evaluation_stops_the_watcher_and_a_rerun_evaluates_every_export_once(few_digits, tmp_path):
    """At its time limit a watcher job is warned (SIGUSR2): it used to have no handler and be killed by the
    scheduler while pretraining went on; it now stops at once with 128 + SIGUSR2 (launch requeues it), and the
    rerun completes the list, every export evaluated exactly once."""
    import os
    import signal

    from eval.__main__ import build_parser
    from eval.watch import evaluate, watch

    run_dir = finished_run_with_exports(tmp_path / "run", few_digits, (3, 6))
    evaluated = []

    def evaluate_then_warned(argv):
        evaluated.append(argv[argv.index("--checkpoint") + 1][-12:-4])
        if len(evaluated) == 2:                       # the time-limit warning during step 6's k-NN
            os.kill(os.getpid(), signal.SIGUSR2)
        evaluate(argv)

    args = build_parser().parse_args(["watch", "--run", str(run_dir), "--protocols", "knn", "--poll-seconds", "0.1",
                                      "--image-size", "16", "--num-workers", "1"])
    handler = signal.getsignal(signal.SIGUSR2)
    assert watch(args, evaluate=evaluate_then_warned) == 128 + signal.SIGUSR2
    assert signal.getsignal(signal.SIGUSR2) is handler                      # the caller's handler is back
    assert sorted(p.name for p in (run_dir / "eval").glob("knn_step*.json")) == ["knn_step0000003.json"]
    assert not (run_dir / "eval/watch.lock").exists()
    assert watch(args, evaluate=evaluate_then_warned) == 0                  # the requeued watcher goes on
    assert evaluated == ["00000003", "00000006", "00000006"]
    assert sorted(p.name for p in (run_dir / "eval").glob("knn_step*.json")) == [
        "knn_step0000003.json", "knn_step0000006.json"]


def test_a_stop_signal_that_lands_in_a_finalizer_still_stops_the_watcher_at_the_next_batch(few_digits, tmp_path):
    """Python drops an exception raised inside a finalizer (`__del__`, a weakref callback): CI's watcher met its
    time-limit warning in numba's weakref callback ("Exception ignored in ... on_disposal"), evaluated on and was
    killed at the limit; and an exception raised where a signal landed, in numba's compiler or an LLVM disposal,
    later crashed the watcher in libllvmlite. The handler raises nothing: it asks for a stop, taken at the next
    batch of the evaluation under way (eval/stop_points.py), which is then redone by the requeued watcher."""
    from eval.__main__ import build_parser
    from eval.watch import evaluate, watch

    run_dir = finished_run_with_exports(tmp_path / "run", few_digits, (3, 6))
    evaluated = []

    class WarnedWhenCollected:
        def __del__(self):
            signal.raise_signal(signal.SIGUSR2)     # the handler runs here: had it raised, Python would drop it

    def evaluate_warned_in_a_finalizer(argv):
        evaluated.append(argv[argv.index("--checkpoint") + 1][-12:-4])
        if len(evaluated) == 1:
            WarnedWhenCollected()                   # collected at once
        evaluate(argv)

    args = build_parser().parse_args(["watch", "--run", str(run_dir), "--protocols", "knn", "--poll-seconds", "0.1",
                                      "--image-size", "16", "--num-workers", "1"])
    assert watch(args, evaluate=evaluate_warned_in_a_finalizer) == 128 + signal.SIGUSR2
    assert evaluated == ["00000003"]                # stopped in step 3's k-NN, at its first batch
    assert not list((run_dir / "eval").glob("knn_step*.json"))
    assert watch(args, evaluate=evaluate_warned_in_a_finalizer) == 0       # the requeued watcher goes on
    assert evaluated == ["00000003", "00000003", "00000006"]
    assert sorted(p.name for p in (run_dir / "eval").glob("knn_step*.json")) == [
        "knn_step0000003.json", "knn_step0000006.json"]


def test_a_second_watcher_is_told_to_leave_the_first_running_not_to_rename_the_run(tmp_path, capsys):
    """It used to be told to "start this one with another name=", which would not evaluate this run at all."""
    import subprocess
    import sys

    from eval.__main__ import main

    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pretrain.runtime.run_lock import RunLock; "
                               f"RunLock({str(run_dir / 'eval')!r}, 'watch.lock').acquire(); print('held', flush=True); "
                               "time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["watch", "--run", str(run_dir)]) == 2
    finally:
        holder.kill()
        holder.wait(timeout=scaled(60))
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "another watcher follows this run" in error
    assert "leave it running" in error and "name=" not in error


def test_a_run_whose_published_list_is_gone_has_every_export_on_disk_evaluated(tmp_path, capsys):
    """exports/published.txt deleted with 4 exports on disk: the watcher said "every published checkpoint is evaluated
    (0 evaluations now)" and exited 0. An export on disk is complete (renamed into place once written), so it is
    evaluated as published; refusing would leave them unevaluated for good, since pretraining starts a new list with
    its next checkpoint. An export being written (a temporary name) is still never read."""
    from eval.__main__ import build_parser
    from eval.results import result_path
    from eval.watch import watch

    run_dir = tmp_path / "run"
    (run_dir / "exports").mkdir(parents=True)
    for step in (3, 6, 9, 12):
        (run_dir / f"exports/backbone_step{step:08d}.pth").write_bytes(b"an export")   # read by `evaluate` only
    (run_dir / "exports/.backbone_step00000015.pth.tmp").write_bytes(b"half an export")
    (run_dir / "finished.json").write_text(json.dumps({"step": 12, "epoch": 1}))
    evaluated = []

    def evaluate(argv):                      # records the evaluation as a protocol would: its result JSON
        step = int(argv[argv.index("--checkpoint") + 1][-12:-4])
        evaluated.append(step)
        result_path(run_dir, argv[0], step).write_text(json.dumps({"step": step}))

    args = build_parser().parse_args(["watch", "--run", str(run_dir), "--protocols", "knn", "--poll-seconds", "0.1"])
    assert watch(args, evaluate=evaluate) == 0
    assert evaluated == [3, 6, 9, 12]
    assert "every published checkpoint is evaluated (4 evaluations now, 0 checkpoints skipped)" in \
        capsys.readouterr().out


def test_a_watcher_at_another_side_evaluates_each_export_once_beside_the_runs_own_results(few_digits, tmp_path, capsys):
    """`eval watch --image-size 24` on a run scored at 16 px: the protocol writes knn_at_24px_step*.json (it used to
    write over the run's own knn_step*.json), and the watcher looks for that name: it used to look for the run's own
    and evaluate the same export again at every poll, never done. The run's own results stay as they were."""
    from eval.__main__ import build_parser
    from eval.watch import evaluate, watch

    run_dir = finished_run_with_exports(tmp_path / "run", few_digits, (3, 6))
    own = {"step": 3, "top1": {"20": 0.5}}
    (run_dir / "eval").mkdir()
    (run_dir / "eval/knn_step0000003.json").write_text(json.dumps(own))
    evaluated = []

    def evaluate_once_each(argv):
        step = int(argv[argv.index("--checkpoint") + 1][-12:-4])
        assert step not in evaluated, f"step {step} evaluated twice: {evaluated}"
        evaluated.append(step)
        evaluate(argv)

    args = build_parser().parse_args(["watch", "--run", str(run_dir), "--protocols", "knn", "--poll-seconds", "0.1",
                                      "--image-size", "24", "--num-workers", "1"])
    assert watch(args, evaluate=evaluate_once_each) == 0
    assert evaluated == [3, 6]
    assert sorted(p.name for p in (run_dir / "eval").glob("knn*_step*.json")) == [
        "knn_at_24px_step0000003.json", "knn_at_24px_step0000006.json", "knn_step0000003.json"]
    assert json.loads((run_dir / "eval/knn_step0000003.json").read_text()) == own
    assert json.loads((run_dir / "eval/knn_at_24px_step0000006.json").read_text())["image_size"] == 24
    events = EventAccumulator(str(run_dir / "tb")).Reload()
    assert [e.step for e in events.Scalars("eval_at_24px/knn_top1_k20")] == [3, 6]
    # The run's own side, passed explicitly, is the run's own result: nothing left to do but step 6's.
    evaluated.clear()
    args = build_parser().parse_args(["watch", "--run", str(run_dir), "--protocols", "knn", "--poll-seconds", "0.1",
                                      "--image-size", "16", "--num-workers", "1"])
    assert watch(args, evaluate=evaluate_once_each) == 0
    assert evaluated == [6] and (run_dir / "eval/knn_step0000006.json").is_file()
