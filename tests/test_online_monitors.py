"""The online monitors (pretrain/online_monitors.py): RankMe against its definition computed by hand, and the
online linear probe, which learns while never touching what the engine trains.

Run as a module (`python -m tests.test_online_monitors OUT_DIR DIGITS_DIR`), this file is the worker of the engine test: one
process, its own process group, results in OUT_DIR/results.json.
"""
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrain.online_monitors import RANKME_EPS, OnlineLinearProbe, rankme
from tests import forked_runs
from tests.engine_helpers import CONFIGS, TINY, engine_for, start_worker, views_and_boxes


def test_rankme_is_the_exponential_of_the_entropy_of_the_normalised_singular_values():
    features = torch.randn(40, 12, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 12)
    singular = np.linalg.svd(features.double().numpy(), compute_uv=False)
    p = [s / singular.sum() + RANKME_EPS for s in singular]
    assert rankme(features) == pytest.approx(math.exp(-sum(q * math.log(q) for q in p)), rel=1e-5)


def test_rankme_is_1_for_a_collapsed_batch_and_the_rank_for_equal_singular_values():
    direction = torch.randn(1, 16)
    collapsed = torch.randn(32, 1) * direction                # every image on one line: rank 1
    assert rankme(collapsed) == pytest.approx(1.0, abs=1e-3)
    orthonormal = torch.linalg.qr(torch.randn(16, 16))[0][:, :8]   # 8 equal singular values
    assert rankme(orthonormal) == pytest.approx(8.0, rel=1e-4)
    assert rankme(torch.randn(200, 16)) < 16.0 + 1e-4          # never above min(N, D)


def test_non_finite_features_give_nan_and_leave_the_probe_finite():
    features = torch.randn(8, 6)
    features[3, 2] = float("nan")
    assert math.isnan(rankme(features))                        # the loop stops on the loss, not on an SVD error
    probe = OnlineLinearProbe(6, 3, lr=0.1, seed=0)
    probe.update(features, torch.arange(8) % 3)
    assert torch.isfinite(probe.linear.weight).all()


def test_the_online_probe_learns_separable_classes_and_skips_unknown_labels():
    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(3, 20, generator=generator) * 3
    labels = torch.randint(0, 3, (300,), generator=generator)
    features = centres[labels] + torch.randn(300, 20, generator=generator)
    probe = OnlineLinearProbe(20, 3, lr=0.05, seed=0)
    accuracies = [probe.update(features[i:i + 30], labels[i:i + 30]) for _ in range(5) for i in range(0, 300, 30)]
    assert accuracies[0] < 0.8 and min(accuracies[-5:]) == 1.0
    assert math.isnan(probe.update(features[:4], torch.full((4,), -1)))        # no labelled image: no accuracy
    mixed = torch.cat([labels[:4], torch.full((4,), -1)])                      # the unknown ones left out
    assert probe.update(features[:8], mixed) == 1.0
    # seeded on its own generator: building it does not move the global random state the model draws from
    torch.manual_seed(5)
    expected = torch.rand(1)
    torch.manual_seed(5)
    OnlineLinearProbe(512, 10, lr=1e-3, seed=0)
    assert torch.equal(torch.rand(1), expected)


def test_rankme_is_computed_only_when_read_and_the_probe_learns_without_being_read(digits, monkeypatch):
    """A step that logs nothing computes no RankMe (an SVD; on a GPU a wait for the device) and reads nothing from the
    device, yet the online probe learns at every step; read, the values are those of the step's features."""
    from pretrain.config import load_config
    from pretrain.methods import base, build_method
    from pretrain.runtime.task import scalar_value

    computed = []
    monkeypatch.setattr(base, "rankme", lambda features: computed.append(features.shape) or rankme(features))
    cfg = load_config(CONFIGS / "simclr_digits.yaml", [*TINY, f"data.train={digits / 'train.beton'}"])
    method = build_method(cfg)
    generator = torch.Generator().manual_seed(0)
    features, labels = torch.randn(6, 2, 512, generator=generator), torch.tensor([0, 1, 2, 0, 1, -1])
    probe = method.online_probe()
    weight, bias = probe.linear.weight.detach().clone(), probe.linear.bias.detach().clone()
    scalars = method.monitor_scalars(features, labels)
    assert computed == []                                              # not computed: nothing has read it
    top1 = scalars["monitor/online_linear_top1"]
    assert isinstance(top1, torch.Tensor) and top1.dim() == 0          # not read back either
    assert not torch.equal(probe.linear.weight, weight)                 # the probe learnt all the same
    assert scalar_value(scalars["monitor/rankme"]) == pytest.approx(rankme(features[:, 0]))
    assert computed == [torch.Size([6, 512])]
    # its top-1 before the step, on both views of the 5 labelled images (the unlabelled one left out)
    predicted = (features[:5].flatten(0, 1) @ weight.T + bias).argmax(dim=1)
    assert scalar_value(top1) == pytest.approx((predicted == labels[:5].repeat_interleave(2)).float().mean().item())


def probe_on_and_off(digits: Path) -> dict:
    """Per ZeRO stage: three AdamW steps, globally clipped at 0.5, of the same method with the online probe on and
    off; the largest parameter difference between the two, how far the probe moved, what it logged."""
    import copy

    from pretrain.config import load_config
    from pretrain.data.views import ViewBatch
    from pretrain.methods import build_method
    from pretrain.runtime.loop import train_step
    from pretrain.runtime.optim import set_schedule_values
    from pretrain.runtime.task import BatchPosition

    results = {}
    for stage in (0, 2):
        trained, logged, probe_moved = {}, {}, 0.0
        for probe in (True, False):
            cfg = load_config(CONFIGS / "simclr_digits.yaml", [
                *TINY, "hvs.enabled=false", f"engine.zero_stage={stage}", "optim.name=adamw", "optim.grad_clip=0.5",
                f"monitor.online_probe={str(probe).lower()}", "monitor.online_probe_lr=0.1",
                f"data.train={digits / 'train.beton'}"])            # its class names size the probe
            torch.manual_seed(0)
            method = build_method(cfg).train()
            engine, optimizer, gradient_edits = engine_for(cfg, method)
            engine.train()
            initial = [p.detach().clone() for p in engine.module.parameters()]
            generator = torch.Generator().manual_seed(3)
            start = None
            for step in range(3):
                views, boxes, labels = views_and_boxes(cfg, generator)
                set_schedule_values(optimizer, 0.01, 0.05, 0.01, step)
                result = train_step(engine, method, ViewBatch(views, boxes, labels, torch.arange(len(labels))),
                                    BatchPosition(0, 0, 0, step), gradient_edits=gradient_edits)
                if probe and start is None:
                    start = copy.deepcopy(method.online_probe().linear.weight.detach())
                logged[str(probe)] = sorted(result.scalars)
            if probe:
                probe_moved = (method.online_probe().linear.weight.detach() - start).abs().max().item()
            trained[probe] = [p.detach().clone() for p in engine.module.parameters()]
            del engine, optimizer
        results[f"stage{stage}"] = {
            "difference": max((a - b).abs().max().item() for a, b in zip(trained[True], trained[False])),
            "moved": max((a - b).abs().max().item() for a, b in zip(trained[True], initial)),
            "probe_moved": probe_moved, "logged": logged}
    return results


def worker(out_dir: Path, digits: Path) -> None:
    start_worker()
    (out_dir / "results.json").write_text(json.dumps(probe_on_and_off(digits)))


@pytest.mark.slow
def test_the_online_probe_never_changes_what_the_engine_trains(digits, tmp_path):
    """With global clipping on (the probe's gradients would change the clip coefficient if the engine saw them)
    and under ZeRO 0 and 2, three steps with the probe equal three steps without it, bit for bit, while the
    probe itself moved and logged its accuracy."""
    forked_runs.run("tests.test_online_monitors", [tmp_path, digits], timeout=600)
    results = json.loads((tmp_path / "results.json").read_text())
    for stage, result in results.items():
        assert result["moved"] > 1e-3 and result["difference"] == 0.0, stage
        assert result["probe_moved"] > 1e-3, stage
        assert "monitor/online_linear_top1" in result["logged"]["True"], stage
        assert "monitor/online_linear_top1" not in result["logged"]["False"], stage
        assert "monitor/rankme" in result["logged"]["False"], stage


def main(argv: list[str]) -> None:
    """The worker's entry: `python -m tests.test_online_monitors OUT_DIR DIGITS`, or forked (tests/forked_runs.py)."""
    worker(Path(argv[0]), Path(argv[1]))


if __name__ == "__main__":
    main(sys.argv[1:])
