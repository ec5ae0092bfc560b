"""DINO's gradient edits (pretrain/runtime/gradient_edits.py) through a real DeepSpeed engine, under ZeRO 0, 1, 2 and 3:

- per-parameter clipping (`optim.grad_clip_per_parameter`): one plain SGD step moves every parameter tensor by
  lr x its own gradient scaled to norm at most `clip`, as DINO's `utils.clip_gradients` -- not the step of the
  global-norm clip;
- the frozen last layer (`method.freeze_last_layer_epochs`): it does not move while frozen, and its first AdamW
  step is AdamW's *first* step (bias-corrected m / sqrt(v) = g / |g|: every element moves by lr), as when its
  gradients are dropped (DINO's `cancel_gradients_last_layer`) -- not a step that carries moments of the frozen
  steps. Every stage ends with the same weights.

Run as a module (`python -m tests.test_gradient_edits OUT_DIR PART`), this file is the worker: one process with one
thread and its own process group, results in OUT_DIR/PART.json; the tests start both parts (clipping, frozen)
side by side.
"""
import json
import sys
from pathlib import Path

import pytest
import torch

from tests import forked_runs
from tests.machine_speed import scaled
from tests.engine_helpers import (CONFIGS, DINO_MULTI_CROP, SMALL_RESNET, TINY, engine_for, one_sgd_step_and_its_reference,
                                  start_worker, views_and_boxes)

pytestmark = pytest.mark.slow          # one worker process: a few DeepSpeed steps under four ZeRO stages

STAGES = (0, 1, 2, 3)
CLIP, LR = 0.01, 0.1


def per_parameter_clipping() -> dict:
    """Per ZeRO stage: the largest error of the engine's SGD step against the hand-computed per-parameter-clipped
    step, and against the global-norm-clipped one."""
    import deepspeed

    from pretrain.config import load_config

    results = {}
    for stage in STAGES:
        cfg = load_config(CONFIGS / "simclr_digits.yaml", [
            *TINY, *SMALL_RESNET, "hvs.enabled=false", f"engine.zero_stage={stage}", "optim.name=sgd", "optim.momentum=0",
            "optim.weight_decay=0", "optim.grad_clip=0", f"optim.grad_clip_per_parameter={CLIP}"])
        method, engine, reference, gradients = one_sgd_step_and_its_reference(cfg, LR)
        norms = [float(g.norm()) for g in gradients]
        global_norm = sum(n * n for n in norms) ** 0.5
        with torch.no_grad():
            expected = [p - LR * g * min(1.0, CLIP / (n + 1e-6)) for p, g, n in zip(reference.parameters(), gradients, norms)]
            global_clip = [p - LR * g * min(1.0, CLIP / (global_norm + 1e-6)) for p, g in zip(reference.parameters(), gradients)]
        with deepspeed.zero.GatheredParameters(list(method.parameters()), modifier_rank=None):
            trained = [p.detach().clone() for p in method.parameters()]
        results[f"stage{stage}"] = {
            "clipped_tensors": sum(n > CLIP for n in norms), "tensors": len(norms),
            "error": max((a - b).abs().max().item() for a, b in zip(trained, expected)),
            "error_vs_global_clip": max((a - b).abs().max().item() for a, b in zip(trained, global_clip)),
            "step_size": LR * CLIP}
        del engine
    return results


def frozen_last_layer() -> dict:
    """Per ZeRO stage: DINO with its last layer frozen for 2 steps (AdamW, no weight decay), 3 steps; how far the
    last layer moved in each, the spread of |step| / lr over its elements in step 3, and the final weights."""
    import deepspeed

    from pretrain.config import load_config
    from pretrain.data.views import ViewBatch
    from pretrain.methods import build_method
    from pretrain.runtime.loop import train_step
    from pretrain.runtime.optim import set_schedule_values
    from pretrain.runtime.task import BatchPosition

    lr, results = 1e-3, {}
    for stage in STAGES:
        cfg = load_config(CONFIGS / "dino_digits.yaml", [
            *TINY, *SMALL_RESNET, "hvs.enabled=false", "method.out_dim=64", f"engine.zero_stage={stage}", "optim.name=adamw",
            "optim.weight_decay=0", "optim.grad_clip=0", "optim.grad_clip_per_parameter=3.0", "optim.epochs=2",
            "method.freeze_last_layer_epochs=1", *DINO_MULTI_CROP])
        torch.manual_seed(0)
        method = build_method(cfg, steps_per_epoch=2)          # frozen for the first 2 steps
        engine, optimizer, gradient_edits = engine_for(cfg, method)
        engine.train()
        last_layer = list(method.head.last_layer.parameters())
        generator = torch.Generator().manual_seed(5)
        moved, ratios = [], None
        for step in range(3):
            with deepspeed.zero.GatheredParameters(last_layer, modifier_rank=None):
                before = [p.detach().clone() for p in last_layer]
            views, boxes, labels = views_and_boxes(cfg, generator)
            set_schedule_values(optimizer, lr, 0.0, lr, step)
            train_step(engine, method, ViewBatch(views, boxes, labels, torch.arange(len(labels))),
                       BatchPosition(step, 0, 0, 0), gradient_edits=gradient_edits)
            method.after_step(engine.global_steps)
            with deepspeed.zero.GatheredParameters(last_layer, modifier_rank=None):
                change = torch.cat([(p.detach() - b).flatten() for p, b in zip(last_layer, before)])
            moved.append(change.abs().max().item())
            ratios = (change.abs() / lr).tolist()
        with deepspeed.zero.GatheredParameters(list(method.parameters()), modifier_rank=None):
            final = {name: p.detach().clone().flatten().tolist()[:50] for name, p in method.named_parameters()}
        ratios.sort()
        results[f"stage{stage}"] = {"moved": moved, "ratio_p01": ratios[len(ratios) // 100],
                                    "ratio_median": ratios[len(ratios) // 2], "ratio_max": ratios[-1], "final": final}
        del engine, optimizer
    return results


PARTS = {"clipping": "per_parameter_clipping", "frozen": "frozen_last_layer"}


def worker(out_dir: Path, part: str) -> None:
    start_worker()
    (out_dir / f"{part}.json").write_text(json.dumps(globals()[PARTS[part]]()))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """Both parts side by side, one process (and one thread) each."""
    out = tmp_path_factory.mktemp("gradient_edits")
    workers = {part: forked_runs.start("tests.test_gradient_edits", [out, part]) for part in PARTS}
    for process in workers.values():
        assert process.wait(scaled(600)) == 0, process.stderr[-4000:]
    return {part: json.loads((out / f"{part}.json").read_text()) for part in PARTS}


@pytest.mark.parametrize("stage", STAGES)
def test_per_parameter_clipping_clips_each_tensor_to_its_own_norm(results, stage):
    r = results["clipping"][f"stage{stage}"]
    assert r["clipped_tensors"] > r["tensors"] // 2              # the bound acted on most tensors
    assert r["error"] < 1e-3 * r["step_size"]
    assert r["error_vs_global_clip"] > 100 * r["error"] + 1e-7    # not the global-norm clip


@pytest.mark.parametrize("stage", STAGES)
def test_frozen_last_layer_gets_no_gradient_and_then_adams_first_step(results, stage):
    r = results["frozen"][f"stage{stage}"]
    assert r["moved"][0] == 0.0 and r["moved"][1] == 0.0         # frozen: not moved
    # AdamW's first step: |m_hat / sqrt(v_hat)| = |g| / (|g| + eps) = 1 for every element with |g| >> 1e-8.
    # Moments carried over from the frozen steps would give other ratios (e.g. 0.64 for a constant gradient).
    assert r["ratio_p01"] > 0.99 and r["ratio_max"] < 1.0 + 1e-4


def test_every_zero_stage_ends_with_the_same_weights(results):
    finals = [results["frozen"][f"stage{stage}"]["final"] for stage in STAGES]
    for final in finals[1:]:
        worst = max(max(abs(a - b) for a, b in zip(final[name], finals[0][name])) for name in finals[0])
        assert worst < 1e-5


def main(argv: list[str]) -> None:
    """The worker's entry: `python -m tests.test_gradient_edits OUT_DIR PART`, or forked (tests/forked_runs.py)."""
    worker(Path(argv[0]), argv[1])


if __name__ == "__main__":
    main(sys.argv[1:])
