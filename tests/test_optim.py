"""Schedules, LARS and Adam against closed forms; the optim.* checks of the schedule."""
import math

import pytest
import torch

from pretrain.config import ConfigError, load_config
from pretrain.runtime.optim import LARS, build_optimizer, cosine_schedule, schedules_from_config, step_schedule


def test_cosine_schedule_with_warmup_closed_form():
    s = cosine_schedule(1.0, 0.1, total_steps=20, warmup_steps=5)
    assert len(s) == 20
    assert s[:5].tolist() == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8])
    for k in range(15):
        assert s[5 + k] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * k / 15)))
    assert s[5] == pytest.approx(1.0) and s[-1] > 0.1


def test_lars_step_closed_form():
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0]))       # |w| = 5
    b = torch.nn.Parameter(torch.tensor([1.0]))
    opt = LARS([{"params": [w]}, {"params": [b], "no_decay": True}], lr=0.5, momentum=0.9,
               weight_decay=0.1, trust_coefficient=0.01)
    w.grad, b.grad = torch.tensor([0.0, 1.0]), torch.tensor([2.0])
    opt.step()
    update = torch.tensor([0.3, 1.4])                        # g + wd * w
    trust = 0.01 * 5 / update.norm()
    torch.testing.assert_close(w.detach(), torch.tensor([3.0, 4.0]) - 0.5 * trust * update)
    torch.testing.assert_close(b.detach(), torch.tensor([1.0 - 0.5 * 2.0]))   # plain SGD, no decay


def test_step_schedule_closed_form_at_the_milestones():
    # paper 002: lr / 10 at 50% and 80% of 40 steps (steps 20 and 32), after a 4-step warm-up from 0
    s = step_schedule(1.0, total_steps=40, milestones=[0.5, 0.8], factor=0.1, warmup_steps=4)
    assert len(s) == 40
    assert s[:4].tolist() == pytest.approx([0.0, 0.25, 0.5, 0.75])
    assert s[4:20].tolist() == pytest.approx([1.0] * 16)                 # up to the step before 50%
    assert s[20:32].tolist() == pytest.approx([0.1] * 12)                # from 50% on
    assert s[32:].tolist() == pytest.approx([0.01] * 8)                  # from 80% on
    # paper 001's decay by 0.9 every 100 of 2000 iterations: the milestones every 5%
    s = step_schedule(3e-4, total_steps=2000, milestones=[k / 20 for k in range(1, 20)], factor=0.9)
    assert s[99] == pytest.approx(3e-4) and s[100] == pytest.approx(2.7e-4)
    assert s[1999] == pytest.approx(3e-4 * 0.9 ** 19)


def test_schedules_from_config_step_and_cosine():
    cfg = load_config("configs/pretrain/smoco_digits.yaml",
                      ["optim.lr_schedule=step", "optim.lr_milestones=[0.5, 0.75]", "optim.lr_step_factor=0.2",
                       "optim.warmup_epochs=0", "optim.epochs=4", "optim.lr_scaling=none", "optim.lr=0.01"])
    lr = schedules_from_config(cfg, steps_per_epoch=10, schedule_steps=40, global_batch=64).lr
    assert lr[[0, 19, 20, 29, 30, 39]].tolist() == pytest.approx([0.01, 0.01, 0.002, 0.002, 0.0004, 0.0004])
    # cosine stays the default of the schema
    cosine = load_config(None, ["optim.epochs=4", "optim.lr_scaling=none", "optim.lr=0.01"])
    assert cosine.optim.lr_schedule == "cosine"
    assert schedules_from_config(cosine, 10, 40, 64).lr.tolist() == pytest.approx(
        cosine_schedule(0.01, 0.0, 40).tolist())


def test_adam_decay_is_coupled_as_torch_adam():
    """optim.name=adam is torch.optim.Adam with the weight decay in the gradient (L2), and no decay on `no_decay`
    groups; after two steps on known gradients it differs from AdamW's decoupled decay."""
    cfg = load_config(None, ["optim.name=adam", "optim.weight_decay=0.5", "optim.betas=[0.8, 0.9]"])
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    b = torch.nn.Parameter(torch.tensor([0.5]))
    optimizer = build_optimizer(cfg, [{"params": [w]}, {"params": [b], "no_decay": True}], peak_lr=0.1)
    assert type(optimizer) is torch.optim.Adam
    grads = [torch.tensor([0.1, 0.2, -0.3]), torch.tensor([-0.2, 0.1, 0.4])]
    expected, m, v = torch.tensor([1.0, -2.0, 3.0]), torch.zeros(3), torch.zeros(3)
    for t, g in enumerate(grads, start=1):                  # Kingma & Ba with g + wd * w
        coupled = g + 0.5 * expected
        m, v = 0.8 * m + 0.2 * coupled, 0.9 * v + 0.1 * coupled ** 2
        expected = expected - 0.1 * (m / (1 - 0.8 ** t)) / ((v / (1 - 0.9 ** t)).sqrt() + 1e-8)
        w.grad, b.grad = g.clone(), torch.tensor([1.0])
        optimizer.step()
    torch.testing.assert_close(w.detach(), expected)
    torch.testing.assert_close(b.detach(), torch.tensor([0.5 - 0.1 - 0.1]))      # Adam without decay: lr per step
    decoupled = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    adamw = build_optimizer(load_config(None, ["optim.name=adamw", "optim.weight_decay=0.5", "optim.betas=[0.8, 0.9]"]),
                            [{"params": [decoupled]}], peak_lr=0.1)
    for g in grads:
        decoupled.grad = g.clone()
        adamw.step()
    assert not torch.allclose(decoupled.detach(), w.detach(), atol=1e-3)


@pytest.mark.parametrize("overrides, match", [
    (["optim.name=adamm"], r"optim.name='adamm' is not one of \('sgd', 'lars', 'adam', 'adamw'\)"),
    (["optim.lr_schedule=linear"], r"optim.lr_schedule='linear' is not one of \('cosine', 'step'\)"),
    (["optim.lr_schedule=step", "optim.lr_milestones=[0.8, 0.5]"],
     r"optim.lr_milestones=\[0.8, 0.5\] must be increasing"),
    (["optim.lr_schedule=step", "optim.lr_milestones=[0.5, 1.0]"], r"fractions of training in \(0, 1\)"),
    (["optim.lr_schedule=step", "optim.lr_milestones=[]"], r"optim.lr_milestones=\[\] must be"),
    (["optim.lr_schedule=step", "optim.lr_step_factor=0"], r"optim.lr_step_factor=0.0 must lie in \(0, 1\]"),
    (["optim.lr_schedule=step", "optim.min_lr=0.001"], r"optim.min_lr=0.001 is the cosine's final lr"),
])
def test_schedule_and_optimizer_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)
