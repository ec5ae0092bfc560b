"""DINO in processes of its own: the EMA teacher after a real DeepSpeed step under ZeRO 0 / 2 / 3 in two
processes, the all-reduced centre, and a whole `python -m pretrain` run with selection, export of the teacher and
resume. (The loss, selection and schedules in one process: test_dino.py.)

Run as a module (`torchrun --nproc-per-node 2 -m tests.test_dino_runs OUT_DIR`), this file is the worker of the
two-process tests.
"""
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from pretrain.methods import build_method
from pretrain.runtime.optim import build_optimizer, set_schedule_values
from tests import forked_runs
from tests.engine_helpers import SMALL_RESNET, start_worker
from tests.test_dino import CONFIG, TINY, random_boxes, random_views, tiny_config


# ==== two processes: EMA after a DeepSpeed step under ZeRO 0 / 2 / 3, the all-reduced centre ====

def two_process_worker(out_dir: Path) -> None:
    """Per stage: one DeepSpeed training step, then the EMA, checked against the gathered student; then the
    centre from different per-rank batches. Each rank writes what it measured to OUT_DIR/rankR.json."""
    import deepspeed
    import torch.distributed as dist

    from pretrain.data.views import ViewBatch
    from pretrain.runtime.loop import initialize_engine, train_step
    from pretrain.runtime.stage import LoopOptions
    from pretrain.runtime.task import BatchPosition

    rank, world = start_worker()
    results = {}
    # bf16 (autocast over fp32 master weights): the EMA must read the fp32 masters, not bf16 copies (issue 10).
    for stage, bf16 in ((0, False), (0, True), (2, True), (3, True)):
        cfg = tiny_config(f"engine.zero_stage={stage}", "data.batch_size=4", "optim.name=adamw", "optim.lr=0.01",
                          "optim.epochs=2", "optim.grad_clip=1.0", "method.momentum_teacher=0.9",
                          "method.freeze_last_layer_epochs=1", *SMALL_RESNET)
        torch.manual_seed(0)
        method = build_method(cfg, steps_per_epoch=2)
        optimizer = build_optimizer(cfg, method.param_groups(), 0.01)
        engine, optimizer, gradient_edits = initialize_engine(method, optimizer, LoopOptions.from_config(cfg))
        student = [*method.backbone.parameters(), *method.head.parameters()]
        with deepspeed.zero.GatheredParameters(student, modifier_rank=None):
            student_before = [p.detach().float().clone() for p in student]
        teacher = [*method.teacher["backbone"].parameters(), *method.teacher["head"].parameters()]
        teacher_before = [p.clone() for p in teacher]
        g = torch.Generator().manual_seed(100 + rank)                    # each rank its own batch
        views = random_views(4, generator=g)
        set_schedule_values(optimizer, 0.01, 0.04, 0.01, 0)
        train_step(engine, method, ViewBatch(views, random_boxes(views, g), torch.zeros(4, dtype=torch.long),
                                             torch.arange(4)), BatchPosition(0, 0, 0, 0), bf16=bf16,
                   gradient_edits=gradient_edits)
        method.after_step(engine.global_steps)
        m = float(method.momentum_schedule[0])
        with deepspeed.zero.GatheredParameters(student, modifier_rank=None):
            student_after = [p.detach().float().clone() for p in student]
        teacher_after = [*method.teacher["backbone"].parameters(), *method.teacher["head"].parameters()]
        ema_error = max((t - (m * t0 + (1 - m) * s)).abs().max().item()
                        for t, t0, s in zip(teacher_after, teacher_before, student_after))
        moved = max((s - s0).abs().max().item() for s, s0 in zip(student_after, student_before))
        last = next(i for i, p in enumerate(student) if p is method.head.last_layer.direction)
        checksum = torch.tensor([sum(t.double().sum().item() for t in teacher_after)])
        sums = [torch.zeros(1, dtype=torch.double) for _ in range(world)]
        dist.all_gather(sums, checksum.double())
        results[f"stage{stage}" + ("_bf16" if bf16 else "")] = {
            "global_steps": engine.global_steps, "ema_error": ema_error, "student_moved": moved,
            "teacher_moved": max((t - t0).abs().max().item() for t, t0 in zip(teacher_after, teacher_before)),
            "last_layer_moved": (student_after[last] - student_before[last]).abs().max().item(),
            "teacher_rank_spread": (max(sums) - min(sums)).item(),
        "student_fp32": all(p.dtype == torch.float32 for p in student)}
        del engine, optimizer

    # The centre: every rank's batch differs; both must get the update of the concatenated batch.
    method = build_method(tiny_config())
    method.center = torch.full((64,), 0.5)
    batches = [{"student": torch.randn(3, 6, 64, generator=torch.Generator().manual_seed(200 + r)),
                "teacher": torch.randn(3, 2, 64, generator=torch.Generator().manual_seed(300 + r)) + r}
               for r in range(world)]
    method.loss(batches[rank], None)
    method.update_center()                                     # once per optimizer step, in after_step
    expected = 0.9 * 0.5 + 0.1 * torch.cat([b["teacher"] for b in batches]).mean(dim=(0, 1))
    results["center_error"] = (method.center - expected).abs().max().item()
    local_only = 0.9 * 0.5 + 0.1 * batches[rank]["teacher"].mean(dim=(0, 1))
    results["center_if_local"] = (method.center - local_only).abs().max().item()
    forked_runs.write_rank_results(out_dir, rank, results)
    dist.barrier()


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory) -> list[dict]:
    return forked_runs.run_rank_workers("tests.test_dino_runs", tmp_path_factory.mktemp("dino_two_processes"))


@pytest.mark.slow
@pytest.mark.parametrize("run", ["stage0", "stage0_bf16", "stage2_bf16", "stage3_bf16"])
def test_teacher_is_the_ema_of_the_student_after_a_deepspeed_step(two_process_results, run):
    """teacher = m * teacher + (1 - m) * master after a real step, the masters gathered in fp32: with bf16 a
    teacher built from bf16 copies of the student would be off by about (1 - m) * |w| * 2^-8 (1e-5 here)."""
    for rank in two_process_results:
        r = rank[run]
        assert r["student_fp32"]
        assert r["global_steps"] == 1
        assert r["student_moved"] > 1e-4 and r["teacher_moved"] > 1e-5         # a real step, a real EMA
        assert r["ema_error"] < 1e-6                                           # teacher = m t0 + (1 - m) s
        assert r["last_layer_moved"] == 0.0                                    # frozen in the first epoch
        assert r["teacher_rank_spread"] == 0.0                                 # the same teacher on both ranks


@pytest.mark.slow
def test_centre_is_all_reduced_over_the_processes(two_process_results):
    for rank in two_process_results:
        assert rank["center_error"] < 1e-6
        assert rank["center_if_local"] > 1e-3                                  # the batches did differ


# ==== a whole run: selection, logging, export of the teacher, resume ====

def pretrain(run_dir: Path, digits: Path, *overrides: str):
    """`python -m pretrain ...` (forked from a server that imported torch: tests/forked_runs.py)."""
    return forked_runs.run("pretrain", [
        "--config", CONFIG, f"run_dir={run_dir}", f"data.train={digits / 'train.beton'}",
        f"data.val={digits / 'val.beton'}", *TINY, "data.batch_size=16", "hvs.enabled=true",
        "engine.checkpoint_every_steps=1", "engine.keep_checkpoints=10", "engine.log_every_steps=1",
        "method.momentum_teacher=0.5", "optim.warmup_epochs=0", "optim.lr=0.01", *overrides],
        env={"OMP_NUM_THREADS": "1"})


def saved_state(run_dir: Path, step: int) -> dict:
    return torch.load(run_dir / f"checkpoints/step{step:08d}/mp_rank_00_model_states.pt", weights_only=False)


@pytest.mark.slow
def test_run_with_hard_view_selection_exports_the_teacher_and_resumes_it(digits, tmp_path):
    run_dir = tmp_path / "run"
    pretrain(run_dir, digits, "engine.max_steps=3")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    for line in lines:
        assert {"dino/teacher_temp", "dino/teacher_momentum", "dino/teacher_entropy", "hvs/selected_iou",
                "hvs/lowest_iou_chosen_frac"} <= set(line)
        assert line["hvs/selected_loss"] >= line["hvs/mean_pair_loss"] - 1e-6
        assert 0 < line["dino/teacher_entropy"] <= math.log(64) + 1e-4

    # backbone.pth is the teacher's backbone of the last checkpoint, not the student's.
    export = torch.load(run_dir / "backbone.pth", weights_only=True)
    state = saved_state(run_dir, 3)
    teacher, student = state["task"]["teacher"], state["module"]
    assert export["step"] == 3 and state["task"]["steps_done"] == 3
    for name, tensor in export["state_dict"].items():
        assert torch.equal(tensor, teacher[f"backbone.{name}"]), name
    assert not torch.equal(export["state_dict"]["conv1.weight"], student["backbone.conv1.weight"])

    # Resume: the teacher of step 3 goes on, so step 4's teacher is the EMA of it and step 4's student.
    second = pretrain(run_dir, digits, "engine.max_steps=5")
    assert f"resumed {run_dir} at step 3" in second.stdout
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5]
    m = lines[3]["dino/teacher_momentum"]
    step4 = saved_state(run_dir, 4)
    assert step4["task"]["steps_done"] == 4
    for name, value in step4["task"]["teacher"].items():
        if "running" in name or "num_batches" in name:          # BatchNorm statistics: the teacher's own
            continue
        expected = m * teacher[name] + (1 - m) * step4["module"][name].float()
        assert torch.allclose(value, expected, atol=1e-5), name
    assert torch.load(run_dir / "backbone.pth", weights_only=True)["step"] == 5


def main(argv: list[str]) -> None:
    """The worker's entry: `python -m tests.test_dino_runs OUT_DIR`, or forked (tests/forked_runs.py)."""
    two_process_worker(Path(argv[0]))


if __name__ == "__main__":
    main(sys.argv[1:])
