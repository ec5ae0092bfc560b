"""DINO: the loss against brute force, hard view selection through one cross-entropy table, the frozen last
layer, the schedules and the config's refusals. (In two processes and in whole runs: test_dino_runs.py.)
"""
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrain.config import ConfigError, load_config
from pretrain.hvs import candidate_combinations, select_hard_views
from pretrain.losses.dino import dino_cross_entropy_table, dino_loss_per_sample
from pretrain.methods import build_method
from pretrain.methods.base import Method
from pretrain.runtime.optim import build_optimizer, set_schedule_values
from tests.engine_helpers import DINO_MULTI_CROP

ROOT = Path(__file__).parents[1]
CONFIG = ROOT / "configs/pretrain/dino_digits.yaml"
TINY = ["data.batch_size=8", "data.num_workers=1", "model.proj_hidden_dim=32", "model.proj_out_dim=16",
        "method.out_dim=64", "engine.image_grid_every_steps=0", *DINO_MULTI_CROP]


@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are tiny: one thread is as fast as two, and many times faster when another process
    shares the two cores (two threads then wait on each other at every operation)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_config(*overrides: str):
    return load_config(CONFIG, [*TINY, *overrides])


def random_views(batch: int, pools=(1, 1, 4), generator: torch.Generator | None = None) -> list[torch.Tensor]:
    sizes = [16, 16] + [8] * (len(pools) - 2)
    return [torch.randn(batch, n, 3, s, s, generator=generator) for n, s in zip(pools, sizes)]


def random_boxes(views: list[torch.Tensor], generator: torch.Generator | None = None) -> list[torch.Tensor]:
    boxes = []
    for v in views:
        corner = torch.rand(v.shape[0], v.shape[1], 2, generator=generator) * 0.5
        boxes.append(torch.cat([corner, corner + 0.5], dim=-1))
    return boxes


# ==== the loss ====

def test_cross_entropy_table_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    # logits of the size a normalised head gives (|l| < ~1), so that float32 keeps 5 digits
    student, teacher, center = (0.3 * torch.randn(3, 5, 7, generator=g), 0.1 * torch.randn(3, 2, 7, generator=g),
                                0.1 * torch.randn(7, generator=g))
    table = dino_cross_entropy_table(student, teacher, center, 0.1, 0.04)
    assert table.shape == (3, 2, 5)
    for b in range(3):
        for i in range(2):
            for j in range(5):
                t = [math.exp((teacher[b, i, k] - center[k]).item() / 0.04) for k in range(7)]
                s = [math.exp(student[b, j, k].item() / 0.1) for k in range(7)]
                expected = -sum(t[k] / sum(t) * math.log(s[k] / sum(s)) for k in range(7))
                assert table[b, i, j].item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_loss_per_sample_is_dinoloss_without_the_batch_mean():
    g = torch.Generator().manual_seed(1)
    batch, views, k = 4, 6, 11
    student, teacher = torch.randn(batch, views, k, generator=g), torch.randn(batch, 2, k, generator=g)
    center = torch.randn(k, generator=g)
    loss = dino_loss_per_sample(student, teacher, center, 0.1, 0.05)
    # facebookresearch/dino DINOLoss.forward, per sample: skip v == iq, divide by the number of terms.
    q = torch.softmax((teacher - center) / 0.05, dim=-1)
    for b in range(batch):
        total, terms = 0.0, 0
        for iq in range(2):
            for v in range(views):
                if v == iq:
                    continue
                total += torch.sum(-q[b, iq] * torch.log_softmax(student[b, v] / 0.1, dim=-1)).item()
                terms += 1
        assert terms == 10 and loss[b].item() == pytest.approx(total / terms, rel=1e-5)


def test_loss_needs_no_gradient_of_the_teacher():
    student, teacher = torch.randn(2, 3, 5, requires_grad=True), torch.randn(2, 2, 5, requires_grad=True)
    dino_loss_per_sample(student, teacher, torch.zeros(5), 0.1, 0.04).sum().backward()
    assert student.grad is not None and teacher.grad is None


@pytest.mark.parametrize("student, teacher, center, temps, match", [
    ((2, 3, 5), (2, 2, 5), (5,), (0.0, 0.04), "must be positive"),
    ((2, 3, 5), (2, 2, 5), (5,), (0.1, -1.0), "must be positive"),
    ((2, 5), (2, 2, 5), (5,), (0.1, 0.04), r"\(B, S, K\)"),
    ((2, 3, 5), (3, 2, 5), (5,), (0.1, 0.04), "must agree"),
    ((2, 3, 5), (2, 2, 4), (5,), (0.1, 0.04), "must agree"),
    ((2, 3, 5), (2, 2, 5), (4,), (0.1, 0.04), r"center must be a \(K,\)"),
    ((2, 1, 5), (2, 2, 5), (5,), (0.1, 0.04), "2 teacher views but only 1 student"),
])
def test_loss_rejects_bad_shapes_and_temperatures(student, teacher, center, temps, match):
    with pytest.raises(ValueError, match=match):
        dino_loss_per_sample(torch.zeros(student), torch.zeros(teacher), torch.zeros(center), *temps)


# ==== the method ====

def test_teacher_lives_outside_the_module_and_is_exported_unless_student():
    method = build_method(tiny_config())
    assert not any(name.startswith("teacher") for name in method.state_dict())
    assert all(p.requires_grad is False for p in method.teacher.parameters())
    assert {id(p) for p in method.teacher.parameters()}.isdisjoint(id(p) for p in method.parameters())
    student = dict(method.backbone.named_parameters())
    for name, p in method.teacher["backbone"].named_parameters():     # a copy: equal values, own storage
        assert torch.equal(p, student[name]) and p.data_ptr() != student[name].data_ptr()
    assert method.backbone_to_export() is method.teacher["backbone"]
    assert build_method(tiny_config("method.export=student")).backbone_to_export() is not None
    exported = build_method(tiny_config("method.export=student"))
    assert exported.backbone_to_export() is exported.backbone


def test_vit_student_drops_paths_at_rates_rising_to_0_1_and_the_teacher_drops_none():
    """main_dino.py:162-166: the ViT student gets drop_path_rate 0.1 (HVS Table 7), the teacher none; the teacher here
    is the student's copy, so its DropPaths become identities: the same weights, a deterministic target in train
    mode. ResNets get none (main_dino.py:176)."""
    from timm.layers import DropPath

    vit = ["model.arch=vit_tiny_patch16_224", "model.stem=imagenet",
           "data.views=[{count: 1, size: 32}, {count: 1, size: 32}, {count: 2, size: 16}]", "hvs.num_views=[2, 2, 4]"]
    cfg = tiny_config(*vit)
    assert cfg.method.drop_path_rate == 0.1
    torch.manual_seed(0)
    method = build_method(cfg).train()
    blocks = method.backbone.blocks
    rates = [block.drop_path1.drop_prob if isinstance(block.drop_path1, DropPath) else 0.0 for block in blocks]
    assert rates == pytest.approx(np.linspace(0, 0.1, len(blocks)).tolist()) and rates[-1] == pytest.approx(0.1)
    teacher = method.teacher["backbone"]
    assert not any(isinstance(module, DropPath) for module in teacher.modules())
    assert teacher.state_dict().keys() == method.backbone.state_dict().keys()
    assert all(torch.equal(t, s) for t, s in zip(teacher.state_dict().values(), method.backbone.state_dict().values()))
    views = [torch.randn(4, 1, 3, 32, 32), torch.randn(4, 1, 3, 32, 32), torch.randn(4, 2, 3, 16, 16)]
    first, second = method(views), method(views)                              # both in train mode
    torch.testing.assert_close(first["teacher"], second["teacher"], rtol=0, atol=0)
    assert not torch.allclose(first["student"], second["student"])            # the student's depth is stochastic
    resnet = build_method(tiny_config())
    assert not any(isinstance(module, DropPath) for module in resnet.backbone.modules())


def test_head_last_layer_is_weight_normalised():
    method = build_method(tiny_config("method.norm_last_layer=true"))
    last = method.head.last_layer
    assert [name for name, _ in last.named_parameters()] == ["direction"]          # norm_last_layer: g fixed to 1
    assert torch.allclose(last.normalised_weight().norm(dim=1), torch.ones(64))
    free = build_method(tiny_config("method.norm_last_layer=false")).head.last_layer
    with torch.no_grad():
        free.magnitude.uniform_(0.5, 2.0)
    expected = free.magnitude * free.direction / free.direction.norm(dim=1, keepdim=True)
    assert torch.allclose(free.normalised_weight(), expected)
    x = torch.randn(3, 16)
    assert torch.allclose(free(x), x @ expected.T, atol=1e-6)


def test_forward_gives_student_on_all_views_and_teacher_on_the_globals():
    method = build_method(tiny_config())
    outputs = method(random_views(4, (2, 2, 5)))                 # an HVS pool
    assert outputs["student"].shape == (4, 9, 64) and outputs["teacher"].shape == (4, 4, 64)
    assert outputs["student"].requires_grad and not outputs["teacher"].requires_grad


def test_teacher_and_last_layers_stay_fp32_under_bf16_autocast():
    """bf16 logits divided by a teacher temperature of 0.04 would be off by ~0.1 in the exponent: under bf16
    autocast the teacher is the fp32 teacher exactly, and both heads' prototype logits come out of fp32 layers."""
    method = build_method(tiny_config())
    views = random_views(4, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        fp32 = method(views)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = method(views)
    assert bf16["teacher"].dtype == torch.float32 and torch.equal(bf16["teacher"], fp32["teacher"])
    assert bf16["student"].dtype == torch.float32
    assert not torch.equal(bf16["student"], fp32["student"])                   # the student's backbone ran in bf16


def test_candidate_losses_equal_the_loop_over_sample_loss():
    method = build_method(tiny_config())
    method.center = torch.randn(64) * 0.1
    g = torch.Generator().manual_seed(2)
    outputs = {"student": torch.randn(5, 10, 64, generator=g), "teacher": torch.randn(5, 4, 64, generator=g)}
    combinations = candidate_combinations([1, 1, 4], [2, 2, 6])                 # 2 * 2 * 15 = 60
    fast = method.candidate_losses(outputs, combinations, torch.zeros(5))
    loop = Method.candidate_losses(method, outputs, combinations, torch.zeros(5))
    assert fast.shape == (5, 60) and torch.allclose(fast, loop, atol=1e-5)
    capped = candidate_combinations([1, 1, 4], [2, 2, 6], max_candidates=16, rng=random.Random(0))
    assert torch.allclose(method.candidate_losses(outputs, capped, None),
                          Method.candidate_losses(method, outputs, capped, None), atol=1e-5)


def test_kl_score_is_the_cross_entropy_less_the_teacher_entropy_by_brute_force():
    """method.hvs_score=kl scores a candidate by the mean over its DINOLoss pairs of KL(P_t || P_s), written here
    as sum_k p_k (log p_k - log q_k) one pair at a time."""
    method = build_method(tiny_config("method.hvs_score=kl"))
    method.center = torch.randn(64) * 0.01            # logits ~ temperature: teachers neither flat nor one-hot
    g = torch.Generator().manual_seed(4)
    outputs = {"student": torch.randn(3, 8, 64, generator=g), "teacher": torch.randn(3, 4, 64, generator=g) * 0.05}
    combinations = candidate_combinations([1, 1, 2], [2, 2, 4])
    fast = method.candidate_losses(outputs, combinations, None)
    t_temp, s_temp = method.teacher_temp(), method.student_temp
    for c, combination in enumerate(combinations):
        kls = []
        for a in range(2):
            for b in range(len(combination)):
                if a == b:
                    continue
                log_p = torch.log_softmax((outputs["teacher"][:, combination[a]] - method.center) / t_temp, dim=-1)
                log_q = torch.log_softmax(outputs["student"][:, combination[b]] / s_temp, dim=-1)
                kls.append((log_p.exp() * (log_p - log_q)).sum(-1))
        torch.testing.assert_close(fast[:, c], torch.stack(kls).mean(0), rtol=1e-4, atol=1e-4)
    cross_entropy = build_method(tiny_config())
    cross_entropy.center = method.center
    assert (cross_entropy.candidate_losses(outputs, combinations, None) - fast).min() > 0   # H(P_t) > 0


def test_selection_logs_the_teacher_entropy_of_the_chosen_and_the_mean_candidate():
    method = build_method(tiny_config()).train()
    g = torch.Generator().manual_seed(6)
    views = random_views(5, (2, 2, 6), g)
    selection = select_hard_views(method, method, views, random_boxes(views, g), torch.zeros(5), method.train_counts)
    with torch.no_grad():
        teacher = method(views)["teacher"]                                  # (5, 4, K): the 4 globals of the pool
    entropy = -(torch.softmax((teacher - method.center) / method.teacher_temp(), -1)
                * torch.log_softmax((teacher - method.center) / method.teacher_temp(), -1)).sum(-1)
    combinations = candidate_combinations(method.train_counts, [2, 2, 6])
    per_candidate = torch.stack([entropy[:, list(c[:2])].mean(-1) for c in combinations], dim=1)    # (5, C)
    chosen = [combinations.index(tuple(row)) for row in selection.chosen.tolist()]
    assert selection.stats["hvs/selected_teacher_entropy"] == pytest.approx(
        per_candidate[torch.arange(5), chosen].mean().item(), rel=1e-4)
    assert selection.stats["hvs/mean_candidate_teacher_entropy"] == pytest.approx(per_candidate.mean().item(),
                                                                                  rel=1e-4)


def test_selection_in_train_mode_is_the_brute_force_argmax_then_the_centre_moves_once_per_step():
    """In train mode, as the engine runs it: the chosen combination of every sample is the argmax of its
    per-candidate losses computed one by one on a forward of the same pool; the centre moves once per
    optimizer step, from the teacher outputs of all of the step's micro-batches."""
    method = build_method(tiny_config()).train()
    g = torch.Generator().manual_seed(3)
    views = random_views(6, (2, 2, 6), g)
    combinations = candidate_combinations(method.train_counts, [2, 2, 6])
    selection = select_hard_views(method, method, views, random_boxes(views, g), torch.zeros(6), method.train_counts)
    with torch.no_grad():
        pool_outputs = method(views)          # BatchNorm on the pool's batch statistics, as in the selection
        brute_force = torch.stack([method.sample_loss(pool_outputs, c, None) for c in combinations], dim=1)
    expected = torch.tensor(combinations)[brute_force.argmax(dim=1)]
    assert selection.chosen.tolist() == expected.tolist()
    torch.testing.assert_close(selection.scores, brute_force, rtol=1e-5, atol=1e-5)

    # Two micro-batches of one optimizer step: the centre does not move until the step ends, then once.
    center_before = method.center.clone()
    teacher_rows = []
    for micro_batch in range(2):
        with torch.no_grad():
            outputs = method(random_views(6, (1, 1, 4), g))
        method.loss(outputs, torch.zeros(6))
        teacher_rows.append(outputs["teacher"].flatten(0, 1))
        assert torch.equal(method.center, center_before)
    method.update_center()
    step_mean = torch.cat(teacher_rows).mean(dim=0)
    assert torch.allclose(method.center, 0.9 * center_before + 0.1 * step_mean, atol=1e-6)
    last_only = 0.9 * center_before + 0.1 * teacher_rows[-1].mean(dim=0)
    assert not torch.allclose(method.center, last_only, atol=1e-4)     # the old per-micro-batch update differs
    entropy = method.scalars()["dino/teacher_entropy"]
    assert 0 < entropy <= math.log(64) + 1e-4


def test_last_layer_frozen_for_its_steps_then_trained():
    cfg = tiny_config("method.freeze_last_layer_epochs=1", "optim.name=adamw", "optim.lr=0.01")
    method = build_method(cfg, steps_per_epoch=2)                # frozen for the first 2 steps
    groups = method.param_groups()
    frozen = [g for g in groups if g.get("frozen_steps")]
    assert all(g["frozen_steps"] == 2 for g in frozen)
    assert {id(p) for g in frozen for p in g["params"]} == {id(p) for p in method.head.last_layer.parameters()}
    assert sorted(id(p) for g in groups for p in g["params"]) == sorted(id(p) for p in method.parameters())
    optimizer = build_optimizer(cfg, groups, 0.01)
    last, first_conv = method.head.last_layer.direction, method.backbone.conv1.weight
    g = torch.Generator().manual_seed(4)
    for step in range(4):
        before_last, before_conv = last.detach().clone(), first_conv.detach().clone()
        set_schedule_values(optimizer, 0.01, 0.04, 0.01, step)
        loss = method.loss(method(random_views(4, generator=g)), None)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        method.after_step(step + 1)
        assert not torch.equal(first_conv, before_conv)
        assert torch.equal(last, before_last) == (step < 2), step


def test_schedules_of_teacher_momentum_and_temperature():
    cfg = tiny_config("optim.epochs=10", "method.momentum_teacher=0.99", "method.teacher_temp=0.07",
                      "method.warmup_teacher_temp=0.04", "method.warmup_teacher_temp_epochs=3")
    method = build_method(cfg, steps_per_epoch=5, schedule_steps=50)      # 10 epochs of 5 steps
    momentum, temp = method.momentum_schedule, method.teacher_temp_schedule
    assert len(momentum) == len(temp) == 50
    assert momentum[0] == pytest.approx(0.99) and momentum[-1] == pytest.approx(1.0, abs=1e-5)
    assert np.all(np.diff(momentum) >= 0)
    assert momentum[25] == pytest.approx(0.995, abs=1e-4)                   # half-way on the cosine
    assert temp[0] == pytest.approx(0.04) and temp[14] == pytest.approx(0.07)  # 15 warm-up steps, ends included
    assert np.allclose(np.diff(temp[:15]), 0.03 / 14) and np.all(temp[14:] == 0.07)
    method.after_step(1)
    assert method.scalars()["dino/teacher_momentum"] == pytest.approx(0.99)
    assert method.teacher_temp() == pytest.approx(temp[1])
    method.after_step(50)                                                    # the last step
    assert method.scalars()["dino/teacher_momentum"] == pytest.approx(momentum[-1])
    assert method.scalars()["dino/teacher_temp"] == pytest.approx(0.07)


def test_state_outside_engine_round_trip():
    source, target = build_method(tiny_config()), build_method(tiny_config("seed=1"))
    with torch.no_grad():
        for p in source.teacher.parameters():
            p.add_(1.0)
    source.center, source.steps_done = torch.randn(64), 7
    target.load_state_outside_engine(source.state_outside_engine())
    for (name, a), b in zip(source.teacher.state_dict().items(), target.teacher.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(target.center, source.center) and target.steps_done == 7
    target.load_state_outside_engine({})                                     # a run saved before DINO: no-op
    assert target.steps_done == 7


@pytest.mark.parametrize("overrides, match", [
    (["data.views.0.count=2"], r"two global crop groups of count 1, then local crop groups; got counts \[2, 1\]"),
    (["data.views.1.count=4"], "Write e.g. data.views"),
    (["method.export=bogus"], "method.export='bogus' is not one of"),
    (["method.hvs_score=entropy"], "method.hvs_score='entropy' is not one of"),
    (["method.teacher_temp=0"], "must be positive"),
    (["method.momentum_teacher=1.5"], r"must lie in \[0, 1\]"),
    (["method.drop_path_rate=1.0"], r"method.drop_path_rate=1.0 must lie in \[0, 1\)"),
])
def test_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(CONFIG, overrides)


def test_config_with_one_view_group_is_refused(tmp_path):
    config = tmp_path / "one_group.yaml"
    config.write_text("method: {name: dino}\ndata: {views: [{count: 2, size: 16}]}\n")
    with pytest.raises(ConfigError, match=r"got counts \[2\]. Write e.g. data.views"):
        load_config(config)
