"""What only a CUDA GPU can check (`make gpu-check`, which also prints `python -m pretrain.bench gpu`):

- a bf16 training step (autocast over fp32 master weights) within bf16's rounding of the fp32 step (10%: the CPU's
  bf16 measured, in the test), for every method;
- the device-side augmentation on CUDA equal to the CPU path for the same random draws;
- hard view selection on CUDA scoring the candidates as the CPU does (within TF32's rounding) and choosing the views
  the CPU chooses wherever two candidates are not tied at that precision;
- DINO's EMA teacher updated from the fp32 master weights under bf16 on CUDA;
- the next batch prepared on a side stream (pretrain/runtime/batch_prefetch.py): the loader's own batches, exactly;
- SyncBatchNorm over NCCL, where two GPUs exist: the running statistics of two processes' uneven batches (6 and 10
  images) equal one BatchNorm's over both batches; on one GPU (NCCL refuses two ranks on one GPU) the test is the
  one-GPU smoke run its name says: a 1-process NCCL run of the engine, finite, at the right step.
"""
import copy
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.engine_helpers import CONFIGS, METHOD_CONFIGS, TINY, engine_for, views_and_boxes

ROOT = Path(__file__).parents[2]
CUDA = torch.device("cuda")


@pytest.fixture(scope="module", autouse=True)
def process_group():
    from pretrain.runtime.distributed import init_distributed

    init_distributed()           # one NCCL process on GPU 0
    yield


@pytest.mark.parametrize("config", METHOD_CONFIGS)
def test_bf16_step_is_the_fp32_step_within_bf16_rounding(config):
    """The layers compute in bf16 under bf16 (fp32 masters), in fp32 under fp32, and the losses agree to the rounding
    bf16 makes: the same step under the CPU's bf16 autocast (the AVX-512-BF16 EPYC, seeds 0-2 of every method,
    2026-11-29) differed from fp32 by up to 8% (the balanced loss: 0.10 at 1.26; SimCLR, DINO, SupCon up to 2.5%)
    and, at SimSiam's losses of about 0.04, by up to 0.004. bf16 keeps 8 bits of mantissa on either device, so the
    bound is that: 10% of the loss (the largest relative difference with a quarter more room), or 0.02 absolute
    where the loss is small (5 times SimSiam's largest)."""
    from pretrain.config import load_config
    from pretrain.data.views import ViewBatch
    from pretrain.methods import build_method
    from pretrain.runtime.loop import train_step
    from pretrain.runtime.optim import set_schedule_values
    from pretrain.runtime.task import BatchPosition

    extra = ["method.out_dim=64"] if config.startswith("dino") else []
    losses, dtypes = {}, {}
    for precision in ("fp32", "bf16"):
        cfg = load_config(CONFIGS / config, [*TINY, *extra, "optim.name=adamw", "optim.lr=0.001", "hvs.enabled=false",
                                             f"engine.precision={precision}"])
        torch.manual_seed(0)
        method = build_method(cfg).to(CUDA)
        engine, optimizer, gradient_edits = engine_for(cfg, method)
        # What the backbone's layers compute in, inside the DeepSpeed engine's forward (which switched a CUDA
        # autocast region off before its config got the torch_autocast section: every GPU "bf16" run was fp32).
        layer = next(m for m in method.backbone.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)))
        seen = set()
        hook = layer.register_forward_hook(lambda module, inputs, output: seen.add(output.dtype))
        engine.train()
        views, boxes, labels = views_and_boxes(cfg, torch.Generator().manual_seed(1))
        views = [v[:, :c].to(CUDA) for v, c in zip(views, method.train_counts)]
        boxes = [b[:, :c].to(CUDA) for b, c in zip(boxes, method.train_counts)]
        set_schedule_values(optimizer, 0.001, 0.0, 0.001, 0)
        loss = train_step(engine, method, ViewBatch(views, boxes, labels.to(CUDA), torch.arange(len(labels))),
                          BatchPosition(0, 0, 0, 0), bf16=precision == "bf16",
                          gradient_edits=gradient_edits).loss
        losses[precision] = loss.item()
        hook.remove()
        dtypes[precision] = seen
        assert all(p.dtype == torch.float32 for p in method.parameters())        # fp32 masters
    assert dtypes == {"fp32": {torch.float32}, "bf16": {torch.bfloat16}}
    assert math.isfinite(losses["bf16"])
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=0.1, abs=0.02)


def test_cuda_augmentation_draws_the_cpu_views(monkeypatch):
    import torch.nn.functional as F

    from pretrain.data import augment
    from pretrain.data.views import ViewGroup

    generator = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, (16, 64, 64, 3), dtype=torch.uint8, generator=generator)
    smooth = (F.interpolate(torch.rand(16, 3, 8, 8, generator=generator), size=(64, 64), mode="bilinear") * 255
              ).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()
    hw = torch.tensor([[300, 400]] * 16)
    groups = [ViewGroup(count=4, size=16), ViewGroup(count=2, size=48, blur_p=0.5, solarize_p=0.2)]
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

    def draw(canvas, device):
        views, boxes = augment.augment_views(canvas.to(device), hw.to(device), groups, mean, std,
                                             torch.Generator().manual_seed(1))
        return [v.cpu() for v in views], [b.cpu() for b in boxes]

    # The same arithmetic on both devices: the CPU made to resize every view by the matmuls, as CUDA does. Equal up
    # to float rounding (a pixel at the solarisation threshold may flip: a few in a million).
    with monkeypatch.context() as patch:
        patch.setattr(augment, "PER_VIEW_MIN_SIZE", 10**6)
        cpu_views, cpu_boxes = draw(noise, "cpu")
    cuda_views, cuda_boxes = draw(noise, CUDA)
    for a, b in zip(cpu_boxes, cuda_boxes):
        torch.testing.assert_close(a, b)
    for a, b in zip(cpu_views, cuda_views):
        assert ((a - b).abs() > 1e-3).float().mean() < 1e-4
    # The CPU's own 48 px views (whole-pixel crops resized one by one, pretrain/data/augment.py) against CUDA's on a
    # smooth image: the same draws, up to the box rounding (< 1 canvas pixel). On noise a sub-pixel shift changes
    # every pixel (mean 0.05 on the CPU alone, 2026-11-26), so this half reads a smooth canvas.
    (cpu_small, cpu_large), _ = draw(smooth, "cpu")
    (cuda_small, cuda_large), _ = draw(smooth, CUDA)
    assert (cpu_small - cuda_small).abs().max() < 1e-3
    difference = (cpu_large - cuda_large).abs() * torch.tensor(std).view(1, 1, 3, 1, 1)
    assert difference.mean() < 0.02                                         # in [0, 1] pixel units (CPU: 0.009)


def test_batches_prepared_on_a_side_stream_are_the_loaders_own(digits):
    """The loop's prefetch copies and augments batch k+1 on a side stream while step k runs: the same kernels on the
    same inputs, so the batches equal the loader's on the default stream exactly; a step that overwrites every batch
    in place (a stand-in for the step's reads, on the default stream) does not change the next one; closing early
    ends FFCV's decode thread."""
    import threading

    from ffcv.loader.epoch_iterator import EpochIterator

    from pretrain.data.loader import build_view_loader
    from pretrain.data.views import ViewGroup
    from pretrain.runtime.batch_prefetch import prepared_one_ahead

    groups = [ViewGroup(count=2, size=16), ViewGroup(count=4, size=8, blur_p=0.5)]
    loader = build_view_loader(digits / "train.beton", groups, 64, canvas_size=16, num_workers=2, device=CUDA)
    plain = [[v.clone() for v in batch.views] + [batch.indices.clone()] for batch in loader.epoch(1)]
    prepared = []
    for batch in prepared_one_ahead(loader.epoch(1), CUDA):
        prepared.append([v.clone() for v in batch.views] + [batch.indices.clone()])
        for view in batch.views:
            view.mul_(0).add_(torch.randn_like(view).matmul(torch.randn(view.shape[-1], view.shape[-1], device=CUDA)))
    assert len(prepared) == len(plain) == len(loader)
    for a, b in zip(plain, prepared):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    early = prepared_one_ahead(loader.epoch(2), CUDA)
    next(early)
    early.close()
    assert [t for t in threading.enumerate() if isinstance(t, EpochIterator)] == []


@pytest.mark.parametrize("config", METHOD_CONFIGS)
def test_selection_on_cuda_chooses_the_cpu_views(config):
    from pretrain.config import load_config
    from pretrain.hvs import select_hard_views
    from pretrain.methods import build_method

    extra = ["method.out_dim=64"] if config.startswith("dino") else []
    cfg = load_config(CONFIGS / config, [*TINY, *extra])
    torch.manual_seed(0)
    cpu = build_method(cfg).train()
    cuda = copy.deepcopy(cpu).to(CUDA)
    views, boxes, labels = views_and_boxes(cfg, torch.Generator().manual_seed(3))
    chosen, scores = {}, {}
    for name, method, device in (("cpu", cpu, "cpu"), ("cuda", cuda, CUDA)):
        selection = select_hard_views(method, method, [v.to(device) for v in views], [b.to(device) for b in boxes],
                                      labels.to(device), method.train_counts, max_candidates=cfg.hvs.max_candidates,
                                      rng=random.Random(0))
        chosen[name], scores[name] = selection.chosen.cpu(), selection.scores.float().cpu()
    # The scores: fp32 on both devices, but cuDNN's convolutions round their operands to TF32 (10 bits of mantissa,
    # 2^-11 = 5e-4 relative each; torch.backends.cudnn.allow_tf32 is on by default, and Hardview leaves it so) through
    # the backbone's 20 convolutions: at most about 20 x 5e-4 = 1e-2 of the scores' scale.
    discrepancy = (scores["cpu"] - scores["cuda"]).abs().max()
    assert discrepancy <= 1e-2 * scores["cpu"].abs().max()
    # The picks: each device trains on the highest-scored candidate of its own scores, so where they part, the CPU's
    # scores of the two candidates lie within twice the discrepancy (a tie at this precision), and nowhere else.
    picks = {name: scores[name].argmax(1) for name in scores}
    same_pick = picks["cpu"] == picks["cuda"]
    assert torch.equal(same_pick, (chosen["cpu"] == chosen["cuda"]).all(1))
    cpu_scores = scores["cpu"]
    margin = cpu_scores.gather(1, picks["cpu"][:, None]) - cpu_scores.gather(1, picks["cuda"][:, None])
    assert (margin[~same_pick] <= 2 * discrepancy).all()
    print(json.dumps({"config": config, "same_pick": same_pick.float().mean().item(), "discrepancy": discrepancy.item()}))


def test_dino_teacher_is_updated_from_the_fp32_masters_under_bf16():
    from pretrain.config import load_config
    from pretrain.data.views import ViewBatch
    from pretrain.methods import build_method
    from pretrain.runtime.loop import train_step
    from pretrain.runtime.optim import set_schedule_values
    from pretrain.runtime.task import BatchPosition

    cfg = load_config(CONFIGS / "dino_digits.yaml", [*TINY, "method.out_dim=64", "optim.name=adamw",
                                                      "hvs.enabled=false", "method.momentum_teacher=0.9"])
    torch.manual_seed(0)
    method = build_method(cfg, steps_per_epoch=2).to(CUDA)
    engine, optimizer, gradient_edits = engine_for(cfg, method)
    engine.train()
    views, boxes, labels = views_and_boxes(cfg, torch.Generator().manual_seed(5))
    views = [v[:, :c].to(CUDA) for v, c in zip(views, method.train_counts)]
    boxes = [b[:, :c].to(CUDA) for b, c in zip(boxes, method.train_counts)]
    method.teacher_on(CUDA)
    teacher_before = [p.clone() for p in [*method.teacher["backbone"].parameters(), *method.teacher["head"].parameters()]]
    set_schedule_values(optimizer, 0.01, 0.04, 0.01, 0)
    train_step(engine, method, ViewBatch(views, boxes, labels.to(CUDA), torch.arange(len(labels))),
               BatchPosition(0, 0, 0, 0), bf16=True, gradient_edits=gradient_edits)
    method.after_step(engine.global_steps)
    m = float(method.momentum_schedule[0])
    student = [*method.backbone.parameters(), *method.head.parameters()]
    teacher = [*method.teacher["backbone"].parameters(), *method.teacher["head"].parameters()]
    assert all(p.dtype == torch.float32 for p in student)
    error = max((t - (m * t0 + (1 - m) * s.detach())).abs().max().item()
                for t, t0, s in zip(teacher, teacher_before, student))
    assert error < 1e-6


SYNC_BATCHNORM_CASE = "two_gpus_statistics_over_both_batches" if torch.cuda.device_count() >= 2 else "one_gpu_smoke_run"


def sync_batchnorm_rank(rank: int, port: int, batches: list[torch.Tensor], out: Path) -> None:
    """One of two processes: the project's conversion (`with_sync_batchnorm`) of a BatchNorm, a train-mode forward of
    this rank's batch on its GPU; rank 0 saves the layer's state."""
    import torch.distributed as dist
    from torch import nn

    from pretrain.runtime.distributed import with_sync_batchnorm

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    layer = with_sync_batchnorm(nn.BatchNorm2d(4), device, 2, True).to(device).train()
    assert isinstance(layer, nn.SyncBatchNorm)
    layer(batches[rank].to(device))
    if rank == 0:
        torch.save({name: value.cpu() for name, value in layer.state_dict().items()}, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("case", [SYNC_BATCHNORM_CASE])
def test_sync_batchnorm(case, digits, tmp_path):
    """Two GPUs: SyncBatchNorm's running statistics after a step of two processes on 6 and 10 images equal one
    BatchNorm's after the 16 (rtol 1e-5: fp32 sums of 16 x 9 x 9 values in another order, per channel; the
    variance is the unbiased one over the 16 images in both). One GPU: the engine's 1-process NCCL run (bf16, 5
    steps) ends finite at step 5, a smoke run and nothing more."""
    if case == "two_gpus_statistics_over_both_batches":
        from torch import nn

        from tests.conftest import free_port

        generator = torch.Generator().manual_seed(0)
        batches = [torch.randn(6, 4, 9, 9, generator=generator) * 3 + 1,
                   torch.randn(10, 4, 9, 9, generator=generator) * 0.5 - 2]       # two processes, other statistics
        torch.multiprocessing.spawn(sync_batchnorm_rank, args=(free_port(), batches, tmp_path / "rank0.pt"), nprocs=2)
        synced = torch.load(tmp_path / "rank0.pt", weights_only=True)
        one = nn.BatchNorm2d(4).train()
        one(torch.cat(batches))
        for name in ("running_mean", "running_var"):
            torch.testing.assert_close(synced[name], getattr(one, name), rtol=1e-5, atol=1e-6)
        assert synced["num_batches_tracked"] == 1
        return
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               "-m", "pretrain", "--config", str(CONFIGS / "simclr_digits.yaml"), f"run_dir={tmp_path / 'run'}",
               f"data.train={digits / 'train.beton'}", f"data.val={digits / 'val.beton'}",
               "engine.max_steps=5", "engine.precision=bf16"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    export = torch.load(tmp_path / "run/backbone.pth", weights_only=True)
    assert export["step"] == 5 and all(torch.isfinite(t).all() for t in export["state_dict"].values()
                                       if t.is_floating_point())
    print(json.dumps({"nccl_processes": 1, "step": export["step"]}))
