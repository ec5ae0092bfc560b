"""s-MoCo (paper 002) and the other DML methods in the engine: the labelled FIFO queue, the loss against the
memory by brute force, hard view selection with a filled memory, the momentum encoder equal to
m * old + (1 - m) * student after a real DeepSpeed step under ZeRO 0 / 2 / 3 with two processes (and XBM's
m = 0), the queue the same on both processes, the weighted contrastive loss gathered across processes equal
to the one-process loss, and a whole `python -m pretrain` run with selection that saves and resumes its queue.

Run as a module (`torchrun --nproc-per-node 2 -m tests.test_smoco OUT_DIR`), this file is the worker of the
two-process tests.
"""
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pretrain.config import ConfigError, load_config
from pretrain.hvs import candidate_combinations, select_hard_views
from pretrain.methods import build_method
from tests import forked_runs
from tests.engine_helpers import SMALL_RESNET, start_worker

ROOT = Path(__file__).parents[1]
CONFIG = ROOT / "configs/pretrain/smoco_digits.yaml"
TINY = ["data.batch_size=8", "data.num_workers=1", "model.proj_hidden_dim=32", "model.proj_out_dim=16",
        "method.memory_size=20", "method.drift_probe_size=4", "method.drift_every_steps=2"]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_config(*overrides: str, config: Path = CONFIG):
    return load_config(config, [*TINY, *overrides] if config == CONFIG else list(overrides))


def random_views(batch: int, count: int = 2, generator: torch.Generator | None = None) -> list[torch.Tensor]:
    return [torch.randn(batch, count, 3, 16, 16, generator=generator)]


def brute_force_memory_loss(queries, labels, memory, memory_labels, margin):
    """HLL with a = b = margin: per query sum_P (1 - S) + sum_N max(0, S - margin), averaged."""
    total = 0.0
    for q, y in zip(queries.double(), labels.tolist()):
        for k, label in zip(memory.double(), memory_labels.tolist()):
            s = float(q @ k)
            total += (1 - s) if label == y else max(0.0, s - margin)
    return total / len(queries)


# ==== the queue and the loss ====

def test_queue_is_fifo_and_keeps_labels_with_their_embeddings():
    method = build_method(tiny_config("method.memory_size=5"))
    keys = F.normalize(torch.randn(12, 16), dim=-1)
    labels = torch.arange(12) + 100
    method.enqueue(keys[:3], labels[:3])
    memory, memory_labels = method.memory()
    assert torch.equal(memory, keys[:3]) and memory_labels.tolist() == [100, 101, 102]   # filling: slot order
    method.enqueue(keys[3:7], labels[3:7])                  # 7 keys into 5 slots: the oldest 2 are gone
    memory, memory_labels = method.memory()
    assert sorted(memory_labels.tolist()) == [102, 103, 104, 105, 106]
    for slot, label in enumerate(memory_labels.tolist()):
        assert torch.equal(memory[slot], keys[label - 100])                           # each key with its label
    assert method.queue_next == 2 and method.queue_filled == 5
    method.enqueue(keys[4:12], labels[4:12])                 # more than the queue: the newest 5 remain
    assert sorted(method.memory()[1].tolist()) == [107, 108, 109, 110, 111]


def test_memory_loss_is_the_brute_force_contrastive_loss_against_the_queue_with_this_batch():
    method = build_method(tiny_config()).train()
    g = torch.Generator().manual_seed(0)
    old_keys = F.normalize(torch.randn(6, 16, generator=g), dim=-1)
    method.enqueue(old_keys, torch.tensor([0, 1, 2, 0, 1, 2]))
    labels = torch.tensor([0, 1, 2, 1, 1, 0, 2, 2])
    with torch.no_grad():
        outputs = method(random_views(8, generator=g))
    loss = method.loss(outputs, labels)
    memory = torch.cat([old_keys, outputs["keys"][:, 1]])                  # the batch's keys (view 2) enqueued
    memory_labels = torch.cat([torch.tensor([0, 1, 2, 0, 1, 2]), labels])
    expected = brute_force_memory_loss(outputs["z"][:, 0], labels, memory, memory_labels, 0.5)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    hard = sum(float(q @ k) > 0.5 and int(y) != int(m) for q, y in zip(outputs["z"][:, 0], labels)
               for k, m in zip(memory, memory_labels))
    assert method.step_hard_negatives[0].item() == hard and method.step_hard_negatives[1].item() == 8
    assert outputs["z"].requires_grad is False and method.queue_filled == 14


def test_mini_batch_training_contrasts_both_views_of_the_batch_without_memory():
    method = build_method(tiny_config("method.memory_size=0"))
    z = F.normalize(torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(1)), dim=-1)
    labels = torch.tensor([0, 1, 0, 2])
    flat, flat_labels = z.flatten(0, 1), labels.repeat_interleave(2)
    expected = sum(brute_force_memory_loss(flat[i:i + 1], flat_labels[i:i + 1],
                                           torch.cat([flat[:i], flat[i + 1:]]),
                                           torch.cat([flat_labels[:i], flat_labels[i + 1:]]), 0.5)
                   for i in range(8)) / 8
    assert method.loss({"z": z}, labels).item() == pytest.approx(expected, rel=1e-5)
    assert method.momentum == 0.0                           # the drift follows the trained encoder itself


def test_selection_with_a_filled_memory_is_the_brute_force_argmax():
    method = build_method(tiny_config("hvs.enabled=true")).train()
    g = torch.Generator().manual_seed(2)
    method.enqueue(F.normalize(torch.randn(10, 16, generator=g), dim=-1), torch.arange(10) % 3)
    views = random_views(6, 4, g)
    boxes = [torch.rand(6, 4, 4, generator=g).sort(dim=-1).values[..., [0, 2, 1, 3]]]
    labels = torch.arange(6) % 3
    selection = select_hard_views(method, method, views, boxes, labels, method.train_counts)
    with torch.no_grad():
        outputs = method(views)
        losses = torch.stack([method.sample_loss(outputs, c, labels) for c in candidate_combinations([2], [4])], 1)
    assert selection.chosen.tolist() == [list(candidate_combinations([2], [4])[i]) for i in losses.argmax(1)]
    assert method.queue_filled == 10                         # scoring never enqueues


def test_drift_is_measured_on_the_fixed_probe_every_k_steps():
    method = build_method(tiny_config("method.momentum=0.5", "method.drift_every_steps=2")).train()
    views = random_views(8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        method(views)
    probe = method.probe.clone()
    assert torch.equal(probe, views[0][:4, 0])
    before = method.probe_embedding.clone()
    with torch.no_grad():
        for p in method.backbone.parameters():
            p.add_(0.05)
    method.after_step(1)
    assert method.scalars().get("smoco/feature_drift") is None            # not a measuring step
    method.after_step(2)
    expected = (method.embed_probe() - before).norm(dim=1).mean().item()
    assert method.scalars()["smoco/feature_drift"] == pytest.approx(expected, rel=1e-5) and expected > 0
    assert torch.equal(method.probe, probe)


# ==== SyncBatchNorm: the key encoder as the student on multi-GPU runs ====

def test_sync_batchnorm_only_on_gpus_with_several_processes_when_enabled():
    from pretrain.runtime.distributed import with_sync_batchnorm

    def batchnorms(module):
        return [type(m) for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]

    for device, world, enabled in (("cpu", 2, True), ("cuda", 1, True), ("cuda", 2, False)):
        module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4))
        assert with_sync_batchnorm(module, torch.device(device), world, enabled) is module
        assert batchnorms(module) == [torch.nn.BatchNorm2d]
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4))
    converted = with_sync_batchnorm(module, torch.device("cuda"), 2, True)    # the conversion itself runs on CPU
    assert batchnorms(converted) == [torch.nn.SyncBatchNorm]


@pytest.mark.parametrize("enabled", [True, False])
def test_key_encoder_gets_sync_batchnorm_where_the_student_does(monkeypatch, enabled):
    """With the decision of a multi-GPU run forced (device cuda, 2 processes), placing the key encoder converts its
    BatchNorm layers as the loop converts the student's, with its weights and statistics kept;
    engine.sync_batchnorm=false leaves them as they are."""
    import pretrain.methods.smoco as smoco
    from pretrain.runtime.distributed import with_sync_batchnorm

    decisions = []

    def as_on_two_gpus(module, device, world_size, enabled):
        decisions.append((device.type, world_size, enabled))
        return with_sync_batchnorm(module, torch.device("cuda"), 2, enabled)

    monkeypatch.setattr(smoco, "with_sync_batchnorm", as_on_two_gpus)
    method = build_method(tiny_config(f"engine.sync_batchnorm={str(enabled).lower()}"))
    before = {name: t.clone() for name, t in method.key_encoder.state_dict().items()}
    method.place(torch.device("cpu"))
    assert decisions == [("cpu", 1, enabled)]
    norms = [m for m in method.key_encoder.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert norms and all(isinstance(m, torch.nn.SyncBatchNorm) == enabled for m in norms)
    after = method.key_encoder.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert not any(isinstance(m, torch.nn.SyncBatchNorm) for m in method.modules())    # the student: the loop's


@pytest.mark.parametrize("overrides, match", [
    (["data.views.0.count=3"], "trains on 2 views per image"),
    (["method.negative_weighting=contrastive"], "negative weighting 'contrastive' is not one of"),
    (["method.hll_a=0.6", "method.hll_b=0.4"], "a <= b"),
    (["method.momentum=1.5"], r"must lie in \[0, 1\]"),
    (["method.memory_size=-1"], "must be >= 0"),
])
def test_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(CONFIG, overrides)


# ==== two processes: the momentum encoder and the queue after a DeepSpeed step under ZeRO 0 / 2 / 3 ====

def two_process_worker(out_dir: Path) -> None:
    import deepspeed
    import torch.distributed as dist

    from pretrain.data.views import ViewBatch
    from pretrain.runtime.loop import initialize_engine, train_step
    from pretrain.runtime.optim import build_optimizer, set_schedule_values
    from pretrain.runtime.stage import LoopOptions
    from pretrain.runtime.task import BatchPosition

    rank, world = start_worker()
    results = {}
    # under bf16 the key encoder must follow the fp32 master weights, not bf16 copies (error ~1e-3)
    for stage, momentum, precision in ((0, 0.9, "fp32"), (2, 0.9, "fp32"), (3, 0.9, "fp32"), (3, 0.0, "fp32"),
                                       (2, 0.9, "bf16")):
        cfg = tiny_config(f"engine.zero_stage={stage}", "data.batch_size=4", "optim.name=adamw", "optim.lr=0.01",
                          f"method.momentum={momentum}", "optim.grad_clip=1.0", f"engine.precision={precision}",
                          *SMALL_RESNET)
        torch.manual_seed(0)
        method = build_method(cfg)
        engine, optimizer, gradient_edits = initialize_engine(method, build_optimizer(cfg, method.param_groups(), 0.01),
                                                              LoopOptions.from_config(cfg))
        student = [*method.backbone.parameters(), *method.projector.parameters()]
        keys_before = [p.clone() for p in [*method.key_encoder["backbone"].parameters(),
                                           *method.key_encoder["projector"].parameters()]]
        with deepspeed.zero.GatheredParameters(student, modifier_rank=None):
            student_before = [p.detach().float().clone() for p in student]
        g = torch.Generator().manual_seed(100 + rank)                        # each rank its own batch
        views = random_views(4, generator=g)
        labels = torch.tensor([0, 1, 2, 3]) + 10 * rank
        set_schedule_values(optimizer, 0.01, 0.0, 0.01, 0)
        train_step(engine, method, ViewBatch(views, [torch.rand(4, 2, 4, generator=g)], labels, torch.arange(4)),
                   BatchPosition(0, 0, 0, 0), bf16=precision == "bf16", gradient_edits=gradient_edits)
        method.after_step(engine.global_steps)
        with deepspeed.zero.GatheredParameters(student, modifier_rank=None):
            student_after = [p.detach().float().clone() for p in student]
        keys_after = [*method.key_encoder["backbone"].parameters(), *method.key_encoder["projector"].parameters()]
        memory, memory_labels = method.memory()
        gathered = [torch.zeros_like(memory) for _ in range(world)]
        dist.all_gather(gathered, memory.contiguous())
        results[f"stage{stage}_m{momentum}" + ("_bf16" if precision == "bf16" else "")] = {
            "global_steps": engine.global_steps,
            "ema_error": max((k - (momentum * k0 + (1 - momentum) * s)).abs().max().item()
                             for k, k0, s in zip(keys_after, keys_before, student_after)),
            "student_moved": max((s - s0).abs().max().item() for s, s0 in zip(student_after, student_before)),
            "memory_labels": memory_labels.tolist(),
            "memory_rank_spread": (gathered[0] - gathered[1]).abs().max().item(),
            "scalars": method.scalars()}
        del engine, optimizer

    # The weighted contrastive loss of the (m, n)-group design, negatives gathered across the processes:
    # the mean of the processes' losses equals the loss of the concatenated batch in one process.
    cfg = load_config(ROOT / "configs/pretrain/weighted_contrastive_digits.yaml",
                      ["data.batch_size=4", "model.proj_hidden_dim=32", "model.proj_out_dim=16",
                       "data.batch_design.images_per_class=2"])
    method = build_method(cfg)
    method.class_counts = torch.tensor([30, 20, 25, 40, 10])
    batches = [F.normalize(torch.randn(4, 1, 16, generator=torch.Generator().manual_seed(300 + r)), dim=-1)
               for r in range(world)]
    labels = [torch.tensor([0, 0, 3, 3]), torch.tensor([1, 1, 4, 4])]
    local = method.loss({"z": batches[rank]}, labels[rank])
    mean = local.detach().clone()
    dist.all_reduce(mean)
    one_process = method.per_sample(torch.cat(batches), torch.cat(labels), gather_negatives=False).mean()
    results["weighted_gathered"] = mean.item() / world
    results["weighted_one_process"] = one_process.item()
    results["weighted_local_only"] = method.per_sample(batches[rank], labels[rank], False).mean().item()
    forked_runs.write_rank_results(out_dir, rank, results)
    dist.barrier()


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory) -> list[dict]:
    return forked_runs.run_rank_workers("tests.test_smoco", tmp_path_factory.mktemp("smoco_two_processes"))


@pytest.mark.slow
@pytest.mark.parametrize("run", ["stage0_m0.9", "stage2_m0.9", "stage3_m0.9", "stage3_m0.0", "stage2_m0.9_bf16"])
def test_key_encoder_is_the_ema_of_the_student_and_the_queue_holds_both_processes_keys(two_process_results, run):
    for rank in two_process_results:
        r = rank[run]
        assert r["global_steps"] == 1 and r["student_moved"] > 1e-4
        assert r["ema_error"] < 1e-6                        # key = m key0 + (1 - m) student; m = 0: XBM, a copy
        assert r["memory_labels"] == [0, 1, 2, 3, 10, 11, 12, 13]      # rank 0's keys, then rank 1's
        assert r["memory_rank_spread"] == 0.0
        assert r["scalars"]["smoco/hard_negatives_per_query"] >= 0


@pytest.mark.slow
def test_weighted_contrastive_gathers_negatives_into_the_one_process_loss(two_process_results):
    for rank in two_process_results:
        assert rank["weighted_gathered"] == pytest.approx(rank["weighted_one_process"], rel=1e-5)
        assert rank["weighted_local_only"] != pytest.approx(rank["weighted_one_process"], rel=1e-3)


# ==== a whole run: selection, logging, queue and key encoder saved and resumed ====

def pretrain(run_dir: Path, data: Path, *overrides: str) -> forked_runs.ForkedRun:
    return forked_runs.run("pretrain", [
        "--config", str(CONFIG), f"run_dir={run_dir}", f"data.train={data / 'train.beton'}",
        f"data.val={data / 'test.beton'}", *TINY, "hvs.enabled=true", "engine.checkpoint_every_steps=1",
        "engine.keep_checkpoints=10", "engine.log_every_steps=1", "method.momentum=0.9", "optim.warmup_epochs=0",
        "optim.lr=0.01", *overrides], timeout=300, env={"OMP_NUM_THREADS": "1"})


def saved_state(run_dir: Path, step: int) -> dict:
    return torch.load(run_dir / f"checkpoints/step{step:08d}/mp_rank_00_model_states.pt", weights_only=False)


@pytest.mark.slow
def test_run_with_selection_saves_and_resumes_the_queue_and_the_key_encoder(digits_dml, tmp_path):
    run_dir = tmp_path / "run"
    pretrain(run_dir, digits_dml, "engine.max_steps=2")
    state = saved_state(run_dir, 2)["task"]
    assert state["queue_filled"] == 16 and state["queue_next"] == 16 and state["steps_done"] == 2
    labels = state["queue_labels"][:16]
    assert ((0 <= labels) & (labels <= 4)).all()                      # training classes 0-4 only
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert "smoco/feature_drift" in lines[1] and "smoco/feature_drift" not in lines[0]   # every 2 steps
    assert all("smoco/hard_negatives" in line and "hvs/selected_loss" in line for line in lines)

    second = pretrain(run_dir, digits_dml, "engine.max_steps=3")
    assert f"resumed {run_dir} at step 2" in second.stdout
    step3 = saved_state(run_dir, 3)
    queue = step3["task"]
    assert queue["queue_filled"] == 20 and queue["queue_next"] == 4           # 24 keys into 20 slots, FIFO
    assert torch.equal(queue["queue"][4:16], state["queue"][4:16])           # the resumed keys kept their slots
    assert torch.equal(queue["queue_labels"][4:16], state["queue_labels"][4:16])
    assert not torch.equal(queue["queue"][:4], state["queue"][:4])           # step 3 overwrote the oldest
    assert torch.equal(queue["probe"], state["probe"])
    for name, value in queue["key_encoder"].items():
        if "running" in name or "num_batches" in name:                     # BatchNorm statistics: its own
            continue
        expected = 0.9 * state["key_encoder"][name] + 0.1 * step3["module"][name].float()
        assert torch.allclose(value, expected, atol=1e-5), name


def main(argv: list[str]) -> None:
    """The worker's entry: `python -m tests.test_smoco OUT_DIR`, or forked (tests/forked_runs.py)."""
    two_process_worker(Path(argv[0]))


if __name__ == "__main__":
    main(sys.argv[1:])
