"""The training step through a real DeepSpeed engine, against hand-computed references:

- bf16 (autocast, fp32 weights and gradients) runs for every method under ZeRO 0, 2 and 3, with hard view
  selection, and a step on the same views from the same weights has a loss within 10% of the fp32 one;
- ZeRO-3 with two accumulated micro-batches, gradient clipping and selection at a lower resolution takes
  exactly the step of a plain-torch reference: the mean gradient of the two micro-batches, clipped to the
  global norm, times the lr; the selection forward ran at 8 px and the training forward at 16 px.

Run as a module (`python -m tests.test_engine_step OUT_DIR PART`), this file is the worker: one process with one
thread and its own process group, results in OUT_DIR/results{PART}.json. The tests start its two parts side by
side (half of the methods each, the second also the ZeRO-3 and clipping steps), one per core.
"""
import copy
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests import forked_runs
from tests.engine_helpers import (BF16_TEST_MODEL, CONFIGS, DINO_MULTI_CROP, METHOD_CONFIGS, TINY, engine_for,
                                  one_sgd_step_and_its_reference, start_worker, views_and_boxes)
from tests.machine_speed import scaled

pytestmark = pytest.mark.slow          # one worker process: DeepSpeed steps of every method under every ZeRO stage


def bf16_runs_for_every_method_and_stage(configs: list[str]) -> dict:
    """Per (config, stage) of `configs`: fp32 and bf16 first losses from the same weights and batch, and after two bf16
    steps whether the loss stayed finite, the weights moved and stayed fp32."""
    import deepspeed

    from pretrain.config import load_config
    from pretrain.data.views import ViewBatch
    from pretrain.methods import build_method
    from pretrain.runtime.loop import train_step
    from pretrain.runtime.optim import set_schedule_values
    from pretrain.runtime.task import BatchPosition

    results = {}
    for config in configs:
        for stage in (0, 2, 3):
            extra = ["method.out_dim=64", *DINO_MULTI_CROP] if config.startswith("dino") else []
            if config.startswith("simsiam"):
                # Per-view BatchNorm over 6 samples in bf16, with every residual branch on (the digits preset),
                # moves the first cosine by 0.023; over 16 samples by 0.005 (measured, seed 0).
                extra = ["data.batch_size=16"]
            overrides = [*TINY, *BF16_TEST_MODEL, *extra, f"engine.zero_stage={stage}", "optim.name=adamw", "optim.lr=0.001"]
            cfg = load_config(CONFIGS / config, overrides)
            losses = {}
            # The fp32 reference loss (the first step's, before any update) is the same under every stage.
            for precision in ("fp32", "bf16") if stage == 0 else ("bf16",):
                torch.manual_seed(0)
                method = build_method(cfg)
                # The engine as a run of this precision builds it (bf16: DeepSpeed's torch_autocast section)
                engine, optimizer, gradient_edits = engine_for(
                    load_config(CONFIGS / config, [*overrides, f"engine.precision={precision}"]), method)
                engine.train()
                generator = torch.Generator().manual_seed(1)
                step_losses = []
                for step in range(2 if precision == "bf16" else 1):
                    views, boxes, labels = views_and_boxes(cfg, generator)
                    # Step 0 trains on the first views without selection (which could pick other views from
                    # bf16-rounded scores), so fp32 and bf16 take the same step; step 1 selects under bf16.
                    hvs = cfg.hvs if step == 1 else {**cfg.hvs, "enabled": False}
                    if step == 0:
                        views = [v[:, :count] for v, count in zip(views, method.train_counts)]
                        boxes = [b[:, :count] for b, count in zip(boxes, method.train_counts)]
                    set_schedule_values(optimizer, 0.001, 0.0, 0.001, step)
                    method.hvs = OmegaConf.create(hvs)
                    loss = train_step(engine, method, ViewBatch(views, boxes, labels, torch.arange(len(labels))),
                                      BatchPosition(step, 0, 0, 0), bf16=precision == "bf16",
                                      gradient_edits=gradient_edits).loss
                    method.after_step(engine.global_steps)
                    step_losses.append(loss.item())
                losses[precision] = step_losses
                if precision == "bf16":
                    parameters = list(method.parameters())
                    with deepspeed.zero.GatheredParameters(parameters, modifier_rank=None):
                        fp32 = all(p.dtype == torch.float32 for p in parameters)
                        torch.manual_seed(0)
                        initial = build_method(cfg)
                        moved = max((p.detach() - q.detach()).abs().max().item()
                                    for p, q in zip(parameters, initial.parameters()))
                    results[f"{config}/stage{stage}"] = {
                        "fp32_loss": results[f"{config}/stage0"]["fp32_loss"] if stage else losses["fp32"][0],
                        "bf16_losses": losses["bf16"],
                        "global_steps": engine.global_steps, "weights_fp32": fp32, "moved": moved,
                        "engine_autocast": engine.torch_autocast_enabled(),
                        "bf16_gradient_reduction": any(hasattr(p, "comm_dtype") for p in parameters)}
                del engine, optimizer
    return results


def zero3_accumulation_clipping_low_resolution_selection() -> dict:
    """One optimizer step of 2 micro-batches under ZeRO-3, against a plain-torch reference."""
    import deepspeed

    from pretrain.config import load_config
    from pretrain.data.views import ViewBatch
    from pretrain.hvs import select_hard_views
    from pretrain.methods import build_method
    from pretrain.runtime.loop import train_step
    from pretrain.runtime.optim import set_schedule_values
    from pretrain.runtime.task import BatchPosition

    clip, lr = 0.05, 0.5
    cfg = load_config(CONFIGS / "simsiam_digits.yaml", [
        *TINY, "engine.zero_stage=3", "optim.grad_accum=2", "optim.name=sgd", "optim.momentum=0",
        "optim.weight_decay=0", f"optim.grad_clip={clip}", "hvs.selection_size=8", "method.fix_pred_lr=false"])
    torch.manual_seed(0)
    method = build_method(cfg).train()
    reference = copy.deepcopy(method)                  # before DeepSpeed partitions the parameters
    engine, optimizer, gradient_edits = engine_for(cfg, method)
    engine.train()
    seen = []
    method.backbone.conv1.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0].shape[-1]))
    generator = torch.Generator().manual_seed(2)
    micro_batches = [views_and_boxes(cfg, generator) for _ in range(2)]
    for views, boxes, labels in micro_batches:
        set_schedule_values(optimizer, lr, 0.0, lr, 0)
        train_step(engine, method, ViewBatch(views, boxes, labels, torch.arange(len(labels))),
                   BatchPosition(0, 0, 0, 0), gradient_edits=gradient_edits)

    # The reference: the same selection and loss in plain torch, the mean gradient, clipped, one SGD step.
    for views, boxes, labels in micro_batches:
        selection = select_hard_views(reference, reference, views, boxes, labels, reference.train_counts,
                                      selection_size=8, max_candidates=cfg.hvs.max_candidates,
                                      rng=BatchPosition(0, 0, 0, 0).rng())
        outputs = reference(selection.views)
        (reference.loss({k: v.float() for k, v in outputs.items()}, labels) / 2).backward()
    gradients = [p.grad for p in reference.parameters()]
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in gradients))
    scale = min(1.0, clip / (norm + 1e-6))
    with torch.no_grad():
        clipped = [p - lr * scale * g for p, g in zip(reference.parameters(), gradients)]
        unclipped = [p - lr * g for p, g in zip(reference.parameters(), gradients)]
        parameters = list(method.parameters())
        with deepspeed.zero.GatheredParameters(parameters, modifier_rank=None):
            trained = [p.detach().clone() for p in parameters]
    return {
        "global_steps": engine.global_steps, "gradient_norm": norm, "input_sides": seen,
        "error_vs_clipped": max((a - b).abs().max().item() for a, b in zip(trained, clipped)),
        "error_vs_unclipped": max((a - b).abs().max().item() for a, b in zip(trained, unclipped)),
        "step_size": max((a - p).abs().max().item() for a, p in zip(clipped, reference.parameters())),
    }


def clipping_as_configured() -> dict:
    """One plain SGD step per (ZeRO stage, optim.grad_clip) against the hand-computed step: with grad_clip=0 the
    whole gradient, whatever its norm (DeepSpeed 0.19.8 clips at 1.0 when its config has no gradient_clipping
    key), with grad_clip=0.5 the gradient scaled to norm 0.5."""
    from pretrain.config import load_config

    lr, results = 0.1, {}
    for stage in (0, 2):
        for clip in (0.0, 0.5):
            cfg = load_config(CONFIGS / "simclr_digits.yaml", [
                *TINY, "hvs.enabled=false", f"engine.zero_stage={stage}", "optim.name=sgd", "optim.momentum=0",
                "optim.weight_decay=0", f"optim.grad_clip={clip}", "method.temperature=0.05"])
            method, engine, reference, gradients = one_sgd_step_and_its_reference(cfg, lr)
            norm = math.sqrt(sum(float(g.pow(2).sum()) for g in gradients))
            scale = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
            with torch.no_grad():
                expected = [p - lr * scale * g for p, g in zip(reference.parameters(), gradients)]
                at_one = [p - lr * min(1.0, 1.0 / (norm + 1e-6)) * g for p, g in zip(reference.parameters(), gradients)]
                trained = [p.detach().clone() for p in method.parameters()]
            results[f"stage{stage}/clip{clip}"] = {
                "gradient_norm": norm,
                "error": max((a - b).abs().max().item() for a, b in zip(trained, expected)),
                "error_vs_clipped_at_1": max((a - b).abs().max().item() for a, b in zip(trained, at_one)),
                "step_size": max((a - p).abs().max().item() for a, p in zip(expected, reference.parameters()))}
            del engine
    return results


PARTS = 2


def worker(out_dir: Path, part: int) -> None:
    start_worker()
    results = {"bf16": bf16_runs_for_every_method_and_stage(METHOD_CONFIGS[part::PARTS])}
    if part == PARTS - 1:
        results.update(zero3=zero3_accumulation_clipping_low_resolution_selection(), clipping=clipping_as_configured())
    (out_dir / f"results{part}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("engine_step")
    workers = [forked_runs.start("tests.test_engine_step", [out, part]) for part in range(PARTS)]
    merged = {"bf16": {}}
    for part, process in enumerate(workers):
        assert process.wait(scaled(600)) == 0, process.stderr[-4000:]
        results = json.loads((out / f"results{part}.json").read_text())
        merged["bf16"].update(results.pop("bf16"))
        merged.update(results)
    return merged


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("config", METHOD_CONFIGS)
def test_bf16_trains_every_method_under_every_zero_stage(results, config, stage):
    r = results["bf16"][f"{config}/stage{stage}"]
    # DeepSpeed's forward keeps the autocast region on (on a GPU it switched it off without its torch_autocast
    # section), and reduces no gradient in bf16 (its default for Linear and Conv weights under that section).
    assert r["engine_autocast"] and not r["bf16_gradient_reduction"]
    assert r["global_steps"] == 2
    assert all(math.isfinite(loss) for loss in r["bf16_losses"])
    # The same step up to bf16 rounding: 8 significant bits, and losses that divide similarities by t = 0.1-0.2
    # magnify it (measured: at most 5% on these inputs, SupCon).
    assert r["bf16_losses"][0] == pytest.approx(r["fp32_loss"], rel=0.1, abs=0.02)   # SimSiam: a cosine near 0
    assert r["weights_fp32"] and r["moved"] > 1e-5                            # fp32 weights, and they trained


def test_zero3_accumulated_clipped_step_equals_the_hand_computed_one(results):
    r = results["zero3"]
    assert r["global_steps"] == 1                              # two micro-batches, one optimizer step
    # selection at 8 px (the pool in one batch), training at 16 px (SimSiam: one forward per view), twice
    assert r["input_sides"] == [8, 16, 16, 8, 16, 16]
    assert r["gradient_norm"] > 0.05 * 10                      # clipping had to act: the norm is 10x the bound
    assert r["error_vs_clipped"] < 1e-3 * r["step_size"]       # the engine took the clipped mean-gradient step
    assert r["error_vs_unclipped"] > 10 * r["error_vs_clipped"] + 1e-6


@pytest.mark.parametrize("stage", [0, 2])
def test_grad_clip_0_applies_the_whole_gradient_and_0_5_clips_to_0_5(results, stage):
    """DeepSpeed clips at 1.0 unless its config says 0: a step with optim.grad_clip=0 and a gradient norm well
    above 1 must take the unclipped SGD step, and one with optim.grad_clip=0.5 the step clipped to 0.5."""
    unclipped, clipped = results["clipping"][f"stage{stage}/clip0.0"], results["clipping"][f"stage{stage}/clip0.5"]
    assert unclipped["gradient_norm"] > 3                                  # a clip at 1.0 would have acted
    assert unclipped["error"] < 1e-3 * unclipped["step_size"]
    assert unclipped["error_vs_clipped_at_1"] > 100 * unclipped["error"] + 1e-6
    assert clipped["gradient_norm"] > 3
    assert clipped["error"] < 1e-3 * clipped["step_size"]


def main(argv: list[str]) -> None:
    """The worker's entry: `python -m tests.test_engine_step OUT_DIR PART`, or forked (tests/forked_runs.py)."""
    worker(Path(argv[0]), int(argv[1]))


if __name__ == "__main__":
    main(sys.argv[1:])
