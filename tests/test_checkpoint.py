"""BatchNorm statistics are averaged across processes before a checkpoint (DeepSpeed never syncs buffers)."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from pretrain.runtime.distributed import average_buffers


def _worker(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    norm = nn.BatchNorm1d(3)
    norm.running_mean.fill_(float(rank))             # rank 0: 0, rank 1: 1
    norm.running_var.fill_(1.0 + 2 * rank)           # rank 0: 1, rank 1: 3
    norm.num_batches_tracked.fill_(5 + rank)         # integer buffers are left alone
    average_buffers(norm)
    # numpy, not tensors: a tensor is passed as a file descriptor that dies with this process
    queue.put((rank, norm.running_mean.numpy().copy(), norm.running_var.numpy().copy(), int(norm.num_batches_tracked)))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_average_buffers_across_two_processes(free_port):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, free_port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {rank: rest for rank, *rest in (queue.get() for _ in procs)}
    for p in procs:
        p.join(60)
    for rank, (mean, var, tracked) in results.items():
        torch.testing.assert_close(torch.from_numpy(mean), torch.full((3,), 0.5))
        torch.testing.assert_close(torch.from_numpy(var), torch.full((3,), 2.0))
        assert tracked == 5 + rank


def test_overflowed_batchnorm_statistics_are_a_divergence_the_checkpoint_refuses(tmp_path):
    """`optim.lr=1e6 optim.warmup_epochs=0` could end "done" with a finite loss and finite weights while BatchNorm's
    running variance had overflowed: every eval-mode feature was then NaN and only `eval knn` found out. The check
    before each checkpoint covers the buffers too, and the run stops as a NaN loss stops it, naming the lr."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from pretrain.runtime.distributed import first_non_finite_tensor, parameters_finite_on_every_rank
    from pretrain.runtime.divergence import TrainingDiverged
    from pretrain.runtime.checkpoint import Checkpointer
    from pretrain.runtime.stage import ConfiguredStage

    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    assert first_non_finite_tensor(net) is None and parameters_finite_on_every_rank(net)
    net[1].running_var[2] = float("inf")
    assert first_non_finite_tensor(net) == "1.running_var" and not parameters_finite_on_every_rank(net)
    net[1].num_batches_tracked.fill_(3)                 # integer buffers cannot be NaN: not looked at

    cfg = OmegaConf.create({"optim": {"lr": 1e6, "warmup_epochs": 0.0, "grad_clip": 0.0, "name": "sgd"}})
    stage = SimpleNamespace(name="training", run_dir=tmp_path, options=SimpleNamespace(keep_checkpoints=0),
                            divergence_advice=lambda: ConfiguredStage.divergence_advice(SimpleNamespace(cfg=cfg)))
    checkpointer = Checkpointer(SimpleNamespace(global_steps=7, module=net), None, stage, {})
    with pytest.raises(TrainingDiverged) as raised:
        checkpointer.save(epoch=0, batch_in_epoch=7, trained_seconds=0.0)
    message = str(raised.value)
    assert "the parameters or BatchNorm statistics are NaN or inf after step 7 (1.running_var" in message
    assert "optim.lr (now 1000000.0)" in message and not (tmp_path / "checkpoints").exists()
