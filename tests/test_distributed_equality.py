"""One process on the whole batch equals two processes on its halves, for every loss and ZeRO stage.

The commonest bug of distributed contrastive learning is a gradient off by the world size, or missing the other
processes' contribution. Here every method takes one plain SGD step (no momentum, no weight decay, no clipping)
from the same weights on a global batch of 8 images: two processes (gloo) with 4 images each under ZeRO 0, 1,
2 and 3, against one process with all 8. The updated parameters and what the method keeps outside the engine
(DINO's teacher and centre, s-MoCo's key encoder and queue) must agree within float tolerance.

BatchNorm: the modules run in eval mode (running statistics, the same in every process). In train mode the batch
statistics of half a batch differ from those of the whole batch by design, not by a bug.

Run as a module (`python -m tests.test_distributed_equality OUT_DIR`, under torchrun for two processes), this
file is the worker: OUT_DIR/world1.pt holds the one-process steps, OUT_DIR/world2.pt how the two-process steps
differ from them.
"""
import sys
from pathlib import Path

import pytest
import torch

from tests import forked_runs
from tests.engine_helpers import DINO_MULTI_CROP, SMALL_RESNET, start_worker

ROOT = Path(__file__).parents[1]
CONFIGS = ROOT / "configs/pretrain"
GLOBAL_BATCH = 8
LABELS = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])          # class-major: a (2, 4)-group batch too
CASES = {   # name: (config, overrides)
    "simclr": ("simclr_digits.yaml", []),
    # a pool of 4 views: the easiest pair per image (scored against every process's views), and every pair at once
    "simclr_easiest_pair": ("simclr_digits.yaml", ["hvs.enabled=true", "hvs.mode=easy"]),
    "simclr_all_pairs": ("simclr_digits.yaml", ["hvs.enabled=true", "hvs.mode=all"]),
    "supcon": ("supcon_digits.yaml", []),
    "tcl": ("tcl_digits.yaml", []),
    "tcl_supervised": ("tcl_supervised_digits.yaml", []),
    "dino": ("dino_digits.yaml", ["method.out_dim=64", "method.freeze_last_layer_epochs=0", *DINO_MULTI_CROP]),
    # DINO's gradient edits act on the reduced gradient: every tensor clipped, the frozen last layer left alone
    "dino_clip_each_parameter": ("dino_digits.yaml", ["method.out_dim=64", "optim.grad_clip_per_parameter=0.01",
                                                      *DINO_MULTI_CROP]),
    "smoco": ("smoco_digits.yaml", []),
    "smoco_minibatch": ("smoco_digits.yaml", ["method.memory_size=0"]),
    "contrastive_balance": ("contrastive_balance_digits.yaml", []),
    "lejepa": ("lejepa_digits.yaml", []),       # SIGReg: a statistic of the whole batch, averaged across processes
    "weighted_contrastive": ("weighted_contrastive_digits.yaml", ["data.batch_design.images_per_class=2"]),
}
STAGES = (0, 1, 2, 3)


def step_once(name: str, stage: int, world: int, rank: int) -> dict:
    """Build the method from seed 0, take one SGD step on this rank's share of the global batch, run after_step;
    return the full parameters and the state outside the engine."""
    import deepspeed

    from pretrain.config import load_config, views_to_draw
    from pretrain.data.views import ViewBatch
    from pretrain.methods import build_method
    from pretrain.runtime.loop import initialize_engine, train_step
    from pretrain.runtime.optim import build_optimizer, set_schedule_values
    from pretrain.runtime.stage import LoopOptions
    from pretrain.runtime.task import BatchPosition

    config, overrides = CASES[name]
    cfg = load_config(CONFIGS / config, [
        f"data.batch_size={GLOBAL_BATCH // world}", "hvs.enabled=false", f"engine.zero_stage={stage}", "optim.name=sgd",
        "optim.momentum=0", "optim.weight_decay=0", "optim.grad_clip=0", "optim.grad_clip_per_parameter=0",
        "model.proj_hidden_dim=32", "model.proj_out_dim=16", *SMALL_RESNET, *overrides])
    generator = torch.Generator().manual_seed(1)
    groups = views_to_draw(cfg)
    views = [torch.randn(GLOBAL_BATCH, g.count, 3, g.size, g.size, generator=generator) for g in groups]
    boxes = [torch.tensor([0.0, 0.0, 1.0, 1.0]).expand(GLOBAL_BATCH, g.count, 4) for g in groups]
    share = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)

    torch.manual_seed(0)
    method = build_method(cfg, steps_per_epoch=1)
    if name == "weighted_contrastive":
        method.class_counts = torch.full((10,), 100)        # N_c of the training set (eq. 25's weights)
    optimizer = build_optimizer(cfg, method.param_groups(), 0.1)
    engine, optimizer, gradient_edits = initialize_engine(method, optimizer, LoopOptions.from_config(cfg))
    engine.eval()                                             # BatchNorm: running statistics (module docstring)
    for module in vars(method).values():                      # and the modules kept outside the registry
        if isinstance(module, torch.nn.Module):              # (s-MoCo's key encoder; DINO sets its teacher's mode)
            module.eval()
    with deepspeed.zero.GatheredParameters(list(method.parameters()), modifier_rank=None):
        initial = {key: p.detach().clone() for key, p in method.named_parameters()}
    set_schedule_values(optimizer, 0.1, 0.0, 0.1, 0)
    batch = ViewBatch([v[share] for v in views], [b[share] for b in boxes], LABELS[share],
                      torch.arange(GLOBAL_BATCH)[share])
    loss = train_step(engine, method, batch, BatchPosition(0, rank, 0, 0), gradient_edits=gradient_edits).loss
    method.after_step(engine.global_steps)
    with deepspeed.zero.GatheredParameters(list(method.parameters()), modifier_rank=None):
        parameters = {key: p.detach().clone() for key, p in method.named_parameters()}
    outside = method.state_outside_engine()
    del engine, optimizer
    moved = max((parameters[key] - initial[key]).abs().max().item() for key in parameters)
    return {"parameters": parameters, "outside": outside, "loss": loss.item(), "moved": moved}


def differences(one: dict, two: dict) -> list[str]:
    """How the two-process step `two` differs from the one-process step `one`: a message per parameter or state
    outside the engine that is not equal within float tolerance (|two - one| <= 1e-6 + 1e-4 |one|, elementwise),
    or whose names differ; empty when they agree."""
    found = []
    for part, expected, got in (("parameters", one["parameters"], two["parameters"]),
                                ("outside", flat(one["outside"]), flat(two["outside"]))):
        if expected.keys() != got.keys():
            found.append(f"{part}: {sorted(expected.keys() ^ got.keys())} only on one side")
            continue
        for key, value in expected.items():
            try:
                if value.is_floating_point():
                    torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-6)
                elif not torch.equal(got[key], value):
                    found.append(f"{part} {key}: {got[key]} != {value}")
            except AssertionError as error:
                found.append(f"{part} {key}: {error}")
    return found


def flat(state) -> dict[str, torch.Tensor]:
    """Every tensor of a nested state, by its path (numbers as 0-d tensors)."""
    if isinstance(state, dict):
        return {f"{key}.{leaf}": value for key, child in state.items() for leaf, value in flat(child).items()}
    if isinstance(state, torch.Tensor):
        return {"": state}
    if isinstance(state, (int, float)):
        return {"": torch.tensor(float(state))}
    return {}


def worker(out_dir: Path) -> None:
    """One process: every case's step, saved whole (OUT_DIR/world1.pt). Two processes: every case's step under
    every stage, each compared with the one-process step as soon as it is taken (`differences`); rank 0 saves the
    comparisons (OUT_DIR/world2.pt). Kept whole, the 40 steps' parameters were 1.8 GB a rank to hold and save."""
    rank, world = start_worker()
    if world == 1:
        torch.save({f"{name}/stage0": step_once(name, 0, 1, 0) for name in CASES}, out_dir / "world1.pt")
        return
    one = torch.load(out_dir / "world1.pt", weights_only=False)
    results = {}
    for name in CASES:
        for stage in STAGES:
            two = step_once(name, stage, world, rank)
            results[f"{name}/stage{stage}"] = {"moved": one[f"{name}/stage0"]["moved"],
                                               "differences": differences(one[f"{name}/stage0"], two)}
    if rank == 0:
        torch.save(results, out_dir / "world2.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """Per case and stage: how far the one-process step moved the weights, and how the two-process step differs."""
    out = tmp_path_factory.mktemp("distributed_equality")
    # The one-process run, then the two-process run, which compares with it (one thread per process), each forked as
    # torchrun's workers would be (tests/forked_runs.py)
    for processes in (1, 2):
        forked_runs.run("tests.test_distributed_equality", [str(out)], timeout=600, processes=processes)
    return torch.load(out / "world2.pt", weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", list(CASES))
def test_two_processes_take_the_one_process_step(results, name, stage):
    result = results[f"{name}/stage{stage}"]
    assert result["moved"] > 1e-4                           # the step changed the weights: the comparison bites
    assert result["differences"] == []


def main(argv: list[str]) -> None:
    """The worker's entry: `python -m tests.test_distributed_equality OUT_DIR`, or forked (tests/forked_runs.py)."""
    worker(Path(argv[0]))


if __name__ == "__main__":
    main(sys.argv[1:])
