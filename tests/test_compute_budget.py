"""A compute budget (optim.budget_pflop, pretrain/runtime/compute_budget.py): a step's FLOPs counted against closed
forms, hard view selection's scoring pass counted apart, the run's model and random draws untouched by the count, the
steps a budget buys, the checkpoints spread over a run, and a budgeted DINO run end to end: it trains what its budget
buys and ends its schedules there, and a resume with another budget is refused."""
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config import load_config
from pretrain.data.views import ViewBatch
from pretrain.methods import build_method
from pretrain.runtime.compute_budget import (PFLOP, StepFlops, budgeted_steps, count_micro_batch_flops, schedule_length,
                                             counted_step_flops)
from pretrain.runtime.config_error import ConfigError
from pretrain.runtime.loop import evenly_spaced_steps
from pretrain.runtime.optim import cosine_schedule
from pretrain.runtime.stage import LoopOptions
from pretrain.runtime.task import BatchLoss, BatchPosition, TrainingTask
from tests.engine_helpers import SMALL_RESNET, TINY, views_and_boxes

ROOT = Path(__file__).parents[1]
POSITION = BatchPosition(0, 0, 0, 0)


class SummedOutput(TrainingTask):
    """The loss of one layer's output summed. With a `pool` input, first a forward of it without gradients, as hard
    view selection scores its pool before the training forward."""

    def __init__(self, layer: nn.Module, pool: torch.Tensor | None = None):
        super().__init__()
        self.layer, self.pool = layer, pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def batch_loss(self, engine, batch: torch.Tensor, position, autocast) -> BatchLoss:
        if self.pool is not None:
            with torch.no_grad():
                engine(self.pool)
        with autocast():
            return BatchLoss(engine(batch).sum())


class SelfAttention(nn.Module):
    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.q = nn.Parameter(torch.randn(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(self.q, self.q, self.q) * x


def test_a_steps_flops_are_the_closed_form_of_its_products_and_the_scoring_pass_is_counted_apart():
    """2 FLOPs per multiply-add, forward and backward (the weight's gradient; the input needs none): a linear layer
    B x K -> N counts 2BKN each way; a 3 x 3 convolution 2 B D H W C 9 each way; attention, in its math form on every
    machine, 4 b h s^2 d forward and 8 backward. A no-grad forward before the training forward is the scoring pass."""
    b, k, n = 5, 7, 3
    linear = nn.Linear(k, n, bias=False)
    assert count_micro_batch_flops(SummedOutput(linear), torch.ones(b, k), POSITION) == StepFlops(0, 4 * b * k * n)
    assert count_micro_batch_flops(SummedOutput(linear, pool=torch.ones(11, k)), torch.ones(b, k), POSITION) == \
        StepFlops(2 * 11 * k * n, 4 * b * k * n)
    c, d, h, w = 2, 4, 6, 5
    convolution = nn.Conv2d(c, d, 3, padding=1, bias=False)
    assert count_micro_batch_flops(SummedOutput(convolution), torch.ones(b, c, h, w), POSITION) == \
        StepFlops(0, 2 * (2 * b * d * h * w * c * 9))
    heads, s, dim = 3, 5, 8
    # FlopCounterMode has no formula for the CPU's fused attention kernel: without the math form this counted 0
    assert count_micro_batch_flops(SummedOutput(SelfAttention((2, heads, s, dim))), torch.ones(1), POSITION) == \
        StepFlops(0, 12 * 2 * heads * s * s * dim)


def test_hard_view_selection_adds_its_scoring_pass_and_leaves_the_training_steps_count():
    """SimCLR with selection: the training step is the one without (the chosen 2 views have the shapes of the 2
    drawn without selection); the scoring pass is the forward of the pool of 4 views, twice the 2 views' forward
    (a forward's products are linear in the batch), plus the candidates' losses (similarities, a sliver). Training on
    every pair (hvs.mode=all) has no scoring pass and trains on the pool: twice the 2 views' training step, plus the
    6 pairs' similarities."""
    counts = {}
    for mode in ("none", "hard", "all"):
        cfg = load_config(ROOT / "configs/pretrain/simclr_digits.yaml", [
            *TINY, *SMALL_RESNET, f"hvs.enabled={mode != 'none'}", f"hvs.mode={'hard' if mode == 'none' else mode}"])
        torch.manual_seed(0)
        method = build_method(cfg)
        views, boxes, labels = views_and_boxes(cfg, torch.Generator().manual_seed(0))
        batch = ViewBatch(views, boxes, labels, torch.arange(len(labels)))
        counts[mode] = count_micro_batch_flops(method, batch, POSITION)
        if mode == "none":
            with torch.no_grad(), torch.utils.flop_counter.FlopCounterMode(display=False) as forward:
                method(views)
    assert counts["none"].selection == 0 and counts["hard"].training == counts["none"].training
    two_views = forward.get_total_flops()
    assert 0 < counts["hard"].selection - 2 * two_views < 0.01 * counts["hard"].selection
    assert counts["all"].selection == 0
    assert 0 < counts["all"].training - 2 * counts["none"].training < 0.01 * counts["all"].training


class FixedBatches:
    def __init__(self, batch):
        self.batch = batch

    def epoch(self, epoch: int, start_batch: int = 0):
        yield self.batch


def test_the_count_leaves_the_model_the_run_trains_and_its_random_draws_as_they_would_have_been():
    """The loop counts on a task built for the count, its random generators restored after: the task the run then
    builds has the parameters and buffers (BatchNorm statistics included) of a run without a count, and every
    generator draws what it would have. The step's count is one micro-batch's times grad_accum times the processes."""
    from pretrain.pretraining import Pretraining

    cfg = load_config(ROOT / "configs/pretrain/simclr_digits.yaml", [*TINY, *SMALL_RESNET, "optim.grad_accum=3"])
    stage = Pretraining(cfg)
    views, boxes, labels = views_and_boxes(cfg, torch.Generator().manual_seed(0))
    batch = ViewBatch(views, boxes, labels, torch.arange(len(labels)))
    built = []
    for count in (True, False):
        torch.manual_seed(0), np.random.seed(0), random.seed(0)
        if count:
            step = counted_step_flops(stage, FixedBatches(batch), 10, torch.device("cpu"), rank=0, world_size=2)
        task = stage.build_task(10, 20, torch.device("cpu"))
        built.append((task.state_dict(), torch.rand(3), np.random.rand(), random.random()))
    (counted, *counted_draws), (plain, *plain_draws) = built
    assert counted.keys() == plain.keys() and any("running_mean" in name for name in plain)
    for name, value in plain.items():
        assert torch.equal(counted[name], value), name
    assert torch.equal(counted_draws[0], plain_draws[0]) and counted_draws[1:] == plain_draws[1:]
    torch.manual_seed(0)
    micro_batch = count_micro_batch_flops(stage.build_task(10, 20, torch.device("cpu")), batch, POSITION)
    assert step == micro_batch.times(3 * 2) and step.selection > 0


def test_a_budget_buys_whole_steps_and_one_that_buys_none_is_refused_with_the_least_that_buys_one():
    step = StepFlops(selection=2 * 10 ** 9, training=5 * 10 ** 9)
    assert budgeted_steps(3.5 * step.total / PFLOP, step) == 3
    assert budgeted_steps(3 * step.total / PFLOP, step) == 3          # not 2 for the decimal's binary rounding
    with pytest.raises(ConfigError) as refused:
        budgeted_steps(1e-7, step)
    assert str(refused.value) == ("optim.budget_pflop=1e-07 buys no optimizer step: one step counts 7,000,000,000 "
                                  "FLOPs (7e-06 PFLOP); set optim.budget_pflop to at least 7e-06")
    odd = StepFlops(0, 5_760_352_256)
    with pytest.raises(ConfigError) as refused:
        budgeted_steps(1e-12, odd)
    least = float(str(refused.value).rsplit(" ", 1)[1])
    assert str(refused.value).endswith("at least 5.76036e-06") and budgeted_steps(least, odd) == 1   # rounded up
    with pytest.raises(ConfigError, match="counts 0 FLOPs"):
        budgeted_steps(1.0, StepFlops(0, 0))


def test_checkpoints_per_run_are_evenly_spaced_and_the_last_is_the_runs_last_step():
    assert evenly_spaced_steps(6, 3) == {2, 4, 6}
    assert evenly_spaced_steps(10, 6) == {2, 4, 5, 7, 9, 10}
    assert evenly_spaced_steps(2, 6) == {1, 2}                    # fewer steps than marks: every step
    assert evenly_spaced_steps(10, 0) == set()
    assert LoopOptions.from_config(load_config(None, ["engine.checkpoints_per_run=6"])).checkpoints_per_run == 6


DINO = ROOT / "configs/pretrain/dino_digits.yaml"
DINO_TINY = ["data.batch_size=16", "data.num_workers=1", "model.proj_hidden_dim=32", "model.proj_out_dim=16",
             "method.out_dim=64", "engine.image_grid_every_steps=0", "engine.log_every_steps=1", "hvs.enabled=true",
             "optim.warmup_epochs=0", "method.momentum_teacher=0.9", *SMALL_RESNET]


@pytest.mark.slow
def test_a_budgeted_run_trains_the_steps_it_buys_ends_its_schedules_there_and_refuses_another_budget(digits, tmp_path):
    """DINO with selection, a budget of 6.5 counted steps: a budget of 1e-9 PFLOP is refused naming the count; 6.5
    steps' budget stopped at step 2 (engine.max_steps) and resumed trains 6 steps, 89 to an epoch: the lr reaches its
    cosine's last value at step 6 and DINO's teacher momentum its schedule's, both of 6 steps; the checkpoints of
    engine.checkpoints_per_run=3 are at steps 2, 4 and 6. A resume with another budget is refused by name."""
    from tests import forked_runs

    run_dir = tmp_path / "run"

    def pretrain(*overrides: str, expect: int = 0):
        return forked_runs.run("pretrain", ["--config", DINO, f"run_dir={run_dir}",
                                            f"data.train={digits / 'train.beton'}", f"data.val={digits / 'val.beton'}",
                                            *DINO_TINY, *overrides], expect=expect, env={"OMP_NUM_THREADS": "1"})

    refused = pretrain("optim.budget_pflop=1e-9", expect=2)
    assert "optim.budget_pflop=1e-09 buys no optimizer step: one step counts " in refused.stderr
    assert not run_dir.exists()                                    # a refused start leaves nothing behind
    flops = int(refused.stderr.split("one step counts ")[1].split(" FLOPs")[0].replace(",", ""))
    budget = f"optim.budget_pflop={6.5 * flops / PFLOP!r}"

    first = pretrain(budget, "engine.max_steps=2")
    assert "buys 6 optimizer steps" in first.stdout
    again = pretrain(f"optim.budget_pflop={7.5 * flops / PFLOP!r}", expect=2)
    assert "the compute budget in PFLOP (optim.budget_pflop, 0: none) was " in again.stderr
    pretrain(budget, "engine.checkpoints_per_run=3")

    record = json.loads((run_dir / "schedule.json").read_text())
    assert (record["schedule_steps"], record["last_step"], record["flops_per_step"]["total"]) == (6, 6, flops)
    assert 0 < record["flops_per_step"]["selection"] < flops and record["steps_per_epoch"] == 1437 // 16
    assert json.loads((run_dir / "finished.json").read_text())["step"] == 6
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    cfg = load_config(DINO, DINO_TINY)
    lr = cosine_schedule(cfg.optim.lr * 16 / 256, cfg.optim.min_lr, 6)
    assert [line["train/lr"] for line in lines] == pytest.approx(lr.tolist())
    assert lines[-1]["dino/teacher_momentum"] == pytest.approx(cosine_schedule(0.9, 1.0, 6)[-1])
    assert sorted(int(path.stem.removeprefix("backbone_step")) for path in (run_dir / "exports").glob("*.pth")) \
        == [2, 4, 6]


def test_a_timed_step_sizes_the_schedule_to_the_steps_that_fit_in_the_minutes_and_the_options_that_clash_are_refused():
    assert schedule_length(100, 89, 0.0, None, budget_s=60.0, step_seconds=0.7) == 85        # floor(60 / 0.7)
    assert schedule_length(100, 89, 0.0, None, budget_s=0.5, step_seconds=0.7) == 1          # at least one step
    assert schedule_length(100, 89, 0.0, None, budget_s=60.0) == 8900                        # not timed: epochs
    with pytest.raises(ConfigError, match="engine.max_minutes, which is 0"):
        load_config(None, ["optim.schedule_from_minutes=true"])
    with pytest.raises(ConfigError, match="optim.budget_pflop=2 both size the schedules"):
        load_config(None, ["optim.schedule_from_minutes=true", "engine.max_minutes=5", "optim.budget_pflop=2"])


@pytest.mark.slow
def test_a_schedule_sized_by_minutes_spans_the_steps_its_timed_step_fits_and_a_resume_keeps_that_time(digits, tmp_path):
    """optim.schedule_from_minutes: the lr of every step is the cosine over the steps that 20 minutes fit at the step
    time measured at the start (schedule.json), not over optim.epochs; stopped at step 3 (engine.max_steps) and
    resumed, the run takes that time from its checkpoint instead of timing again, and another engine.max_minutes,
    which would be another schedule, is refused by name."""
    from tests import forked_runs

    run_dir = tmp_path / "run"

    def pretrain(*overrides: str, expect: int = 0):
        return forked_runs.run("pretrain", ["--config", DINO, f"run_dir={run_dir}",
                                            f"data.train={digits / 'train.beton'}", f"data.val={digits / 'val.beton'}",
                                            *DINO_TINY, "hvs.enabled=false", "optim.schedule_from_minutes=true",
                                            *overrides], expect=expect)

    first = pretrain("engine.max_minutes=20", "engine.max_steps=3", "engine.checkpoint_every_steps=3")
    record = json.loads((run_dir / "schedule.json").read_text())
    assert record["sized_by"] == "minutes" and record["budget_minutes"] == 20 and record["step_seconds"] > 0
    assert record["schedule_steps"] == math.floor(20 * 60 / record["step_seconds"]) != 100 * record["steps_per_epoch"]
    assert "timed now" in first.stdout
    second = pretrain("engine.max_minutes=20", "engine.max_steps=5")
    assert "resumed" in second.stdout and "timed at the run's start (kept in its checkpoint)" in second.stdout
    assert json.loads((run_dir / "schedule.json").read_text()) == {**record, "last_step": 5}
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    cfg = load_config(DINO, DINO_TINY)
    lr = cosine_schedule(cfg.optim.lr * 16 / 256, cfg.optim.min_lr, record["schedule_steps"])
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5]
    assert [line["train/lr"] for line in lines] == pytest.approx(lr[:5].tolist())
    refused = pretrain("engine.max_minutes=30", "engine.max_steps=6", expect=2)
    assert "the optimizer steps every schedule spans (a timed schedule: engine.max_minutes changed) was" in refused.stderr
