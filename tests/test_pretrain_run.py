"""Whole runs of `python -m pretrain` as a user starts them: one process end to end, and two processes
under DeepSpeed ZeRO-2 that checkpoint, are killed, and resume at the right step."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pretrain.config import load_config
from pretrain.data.digits import write_digits
from pretrain.optim import cosine_schedule, scaled_lr

ROOT = Path(__file__).parents[1]
CONFIG = ROOT / "configs/pretrain/simclr_digits.yaml"
TINY = ["data.batch_size=32", "data.num_workers=1", "model.proj_hidden_dim=64", "model.proj_out_dim=32",
        "engine.log_every_steps=1", "engine.image_grid_every_steps=2"]


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    out = tmp_path_factory.mktemp("digits")
    write_digits(out)
    return out


def pretrain_command(run_dir: Path, digits: Path, *overrides: str, processes: int = 1) -> list[str]:
    launcher = [sys.executable, "-m", "pretrain"] if processes == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes), "-m", "pretrain"]
    return launcher + ["--config", str(CONFIG), f"run_dir={run_dir}", f"data.train={digits / 'train.beton'}",
                       f"data.val={digits / 'val.beton'}", *TINY, *overrides]


def kill_process_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants at once, as a node failure or `scancel` would (torchrun's
    workers run in sessions of their own, so killing the launcher's group alone leaves them running)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        tree.append(current)
        frontier += children.get(current, [])
    for member in tree:
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(command: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_tiny_run_end_to_end_with_hard_view_selection(digits, tmp_path):
    run_dir = tmp_path / "run"
    run(pretrain_command(run_dir, digits, "hvs.enabled=true", "engine.max_steps=4", "engine.checkpoint_every_steps=2"))

    assert load_config(run_dir / "config.yaml").hvs.enabled is True     # the resolved config, re-loadable
    export = torch.load(run_dir / "backbone.pth", weights_only=True)
    assert export["arch"] == "resnet18" and export["step"] == 4 and "conv1.weight" in export["state_dict"]

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    for line in lines:
        assert 0 <= line["hvs/lowest_iou_chosen_frac"] <= 1
        assert line["hvs/selected_loss"] >= line["hvs/mean_pair_loss"] - 1e-6   # the hardest pair is chosen
        assert 0 <= line["perf/data_wait_frac"] <= 1 and line["perf/images_per_s"] > 0

    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"images": 0}).Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/weight_decay", "perf/images_per_s", "perf/data_wait_frac",
            "hvs/selected_loss", "hvs/mean_pair_loss", "hvs/selected_iou", "hvs/mean_pair_iou",
            "hvs/lowest_iou_chosen_frac"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    assert {"hvs/pool", "hvs/selected"} <= set(events.Tags()["images"])

    # The same directory with another architecture is refused, with what to do, and nothing is lost.
    clash = subprocess.run(pretrain_command(run_dir, digits, "model.arch=resnet34"), cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert clash.returncode == 1
    assert "model.arch='resnet18'" in clash.stderr and "Use another run name" in clash.stderr
    assert torch.load(run_dir / "backbone.pth", weights_only=True)["step"] == 4
    # A checkpoint whose heads differ in shape is refused by name; so is a `latest` naming a missing one.
    shapes = subprocess.run(pretrain_command(run_dir, digits, "model.proj_hidden_dim=48"), cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert shapes.returncode == 1 and "does not match this run's model" in shapes.stderr
    assert load_config(run_dir / "config.yaml").model.proj_hidden_dim == 64      # the record is intact
    (run_dir / "checkpoints" / "latest").write_text("step00000099")
    missing = subprocess.run(pretrain_command(run_dir, digits), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 1 and "names checkpoint 'step00000099', which is missing" in missing.stderr
    (run_dir / "checkpoints" / "latest").write_text("step00000004")

    knn = subprocess.run([sys.executable, "-m", "eval", "knn", "--run", str(run_dir), "--k", "10", "20"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert knn.returncode == 0, knn.stderr[-3000:]
    results = json.loads(next((run_dir / "eval").glob("knn*.json")).read_text())
    assert results["step"] == 4 and 0.1 < float(results["top1"]["20"]) <= 1.0


def test_two_processes_zero2_killed_then_resumed_at_the_right_step(digits, tmp_path):
    run_dir = tmp_path / "run"
    common = ("engine.zero_stage=2", "engine.checkpoint_every_steps=2", "optim.warmup_epochs=0.5")
    first = subprocess.Popen(pretrain_command(run_dir, digits, *common, processes=2), cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.time() + 240
    while not latest.exists() and first.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    kill_process_tree(first.pid)                   # a crash: no clean shutdown, no final checkpoint
    first.wait()
    time.sleep(1)
    assert latest.exists(), first.stderr.read().decode()[-3000:]
    assert not (run_dir / "finished.json").exists()
    killed_at = int(latest.read_text().strip().removeprefix("step"))
    time.sleep(2)                                  # nothing of the killed run goes on writing
    assert int(latest.read_text().strip().removeprefix("step")) == killed_at
    killed_at = int(latest.read_text().strip().removeprefix("step"))
    assert killed_at >= 2 and killed_at % 2 == 0
    # every rank wrote its ZeRO-2 optimizer shard
    assert len(list((run_dir / "checkpoints" / latest.read_text().strip()).glob("*optim_states.pt"))) == 2

    stop = killed_at + 3
    second = run(pretrain_command(run_dir, digits, *common, f"engine.max_steps={stop}", processes=2))
    assert f"at step {killed_at} " in second.stdout
    assert json.loads((run_dir / "finished.json").read_text())["step"] == stop
    export = torch.load(run_dir / "backbone.pth", weights_only=True)
    assert export["step"] == stop

    # The schedule continued where it stopped: every logged lr is the schedule's value at its step.
    cfg = load_config(run_dir / "config.yaml")
    steps_per_epoch = (1437 // 2) // 32
    peak = scaled_lr(cfg, global_batch=2 * 32)
    schedule = cosine_schedule(peak, cfg.optim.min_lr, cfg.optim.epochs * steps_per_epoch,
                               int(cfg.optim.warmup_epochs * steps_per_epoch))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, stop + 1))   # each step once, none lost
    resumed = [line for line in lines if line["step"] > killed_at]
    for line in resumed:
        assert line["train/lr"] == pytest.approx(schedule[line["step"] - 1])
    events = EventAccumulator(str(run_dir / "tb")).Reload()
    assert [e.step for e in events.Scalars("train/lr")] == list(range(1, stop + 1))


def test_simsiam_zero3_accumulation_adamw_clipping_low_res_selection(digits, tmp_path):
    """The other engine paths in one short run: ZeRO-3 (export gathers the partitioned backbone), two
    micro-batches per optimizer step, AdamW, gradient clipping, selection at a lower resolution."""
    run_dir = tmp_path / "run"
    config = ROOT / "configs/pretrain/simsiam_digits.yaml"
    command = pretrain_command(run_dir, digits, "engine.zero_stage=3", "optim.grad_accum=2", "optim.name=adamw",
                               "optim.lr=0.001", "optim.grad_clip=1.0", "hvs.enabled=true", "hvs.selection_size=8",
                               "engine.max_steps=2", "engine.image_grid_every_steps=0", "model.pred_hidden_dim=16")
    command[command.index(str(CONFIG))] = str(config)
    run(command)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert all(-1 <= line["train/loss"] <= 1 for line in lines)        # negative cosine
    state = torch.load(run_dir / "checkpoints/step00000002/zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False)
    assert state["batch_in_epoch"] == 4                                    # 2 steps x 2 micro-batches
    export = torch.load(run_dir / "backbone.pth", weights_only=True)
    assert export["step"] == 2
    assert all(t.numel() > 0 for t in export["state_dict"].values())       # gathered, not ZeRO-3 placeholders
