"""Schedules and LARS against closed forms."""
import math

import pytest
import torch

from pretrain.optim import LARS, cosine_schedule


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
