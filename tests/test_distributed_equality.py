"""One process on the whole batch equals two processes on its halves, for every loss and ZeRO stage.

The commonest bug of distributed contrastive learning is a gradient off by the world size, or missing the other
processes' contribution. Here every method takes one plain SGD step (no momentum, no weight decay, no clipping)
from the same weights on a global batch of 8 images: two processes (gloo) with 4 images each under ZeRO 0, 1,
2 and 3, against one process with all 8. The updated parameters and what the method keeps outside the engine
(DINO's teacher and centre, s-MoCo's key encoder and queue) must agree within float tolerance.

BatchNorm: the modules run in eval mode (running statistics, the same in every process). In train mode the batch
statistics of half a batch differ from those of the whole batch by design, not by a bug.

Run as a module (`python -m tests.test_distributed_equality OUT_DIR`, under torchrun for two processes), this
file is the worker: OUT_DIR/world{N}.pt holds what it measured.
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.engine_helpers import DINO_MULTI_CROP

ROOT = Path(__file__).parents[1]
CONFIGS = ROOT / "configs/pretrain"
GLOBAL_BATCH = 8
LABELS = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])          # class-major: a (2, 4)-group batch too
CASES = {   # name: (config, overrides)
    "simclr": ("simclr_digits.yaml", []),
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
        "model.proj_hidden_dim=32", "model.proj_out_dim=16", *overrides])
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


def worker(out_dir: Path) -> None:
    from pretrain.runtime.distributed import init_distributed

    rank, world, _ = init_distributed()
    torch.set_num_threads(1)
    stages = STAGES if world > 1 else (0,)
    results = {f"{name}/stage{stage}": step_once(name, stage, world, rank) for name in CASES for stage in stages}
    if rank == 0:
        torch.save(results, out_dir / f"world{world}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("distributed_equality")
    # The one-process and the two-process run side by side (one thread per process; torchrun's --standalone
    # rendezvous takes a free port each).
    runs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                              str(processes), "-m", "tests.test_distributed_equality", str(out)],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for processes in (1, 2)]
    for run in runs:
        _, stderr = run.communicate(timeout=600)
        assert run.returncode == 0, stderr[-4000:]
    return {world: torch.load(out / f"world{world}.pt", weights_only=False) for world in (1, 2)}


def flat(state) -> dict[str, torch.Tensor]:
    """Every tensor of a nested state, by its path (numbers as 0-d tensors)."""
    if isinstance(state, dict):
        return {f"{key}.{leaf}": value for key, child in state.items() for leaf, value in flat(child).items()}
    if isinstance(state, torch.Tensor):
        return {"": state}
    if isinstance(state, (int, float)):
        return {"": torch.tensor(float(state))}
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", list(CASES))
def test_two_processes_take_the_one_process_step(results, name, stage):
    one, two = results[1][f"{name}/stage0"], results[2][f"{name}/stage{stage}"]
    assert one["moved"] > 1e-4                              # the step changed the weights: the comparison bites
    assert one["parameters"].keys() == two["parameters"].keys()
    for key, expected in one["parameters"].items():
        torch.testing.assert_close(two["parameters"][key], expected, rtol=1e-4, atol=1e-6, msg=lambda m: f"{key}: {m}")
    expected_outside, got_outside = flat(one["outside"]), flat(two["outside"])
    assert expected_outside.keys() == got_outside.keys()
    for key, expected in expected_outside.items():
        if expected.is_floating_point():
            torch.testing.assert_close(got_outside[key], expected, rtol=1e-4, atol=1e-6, msg=lambda m: f"{key}: {m}")
        else:
            assert torch.equal(got_outside[key], expected), key


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
