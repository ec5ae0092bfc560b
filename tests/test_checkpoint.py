"""BatchNorm statistics are averaged across processes before a checkpoint (DeepSpeed never syncs buffers)."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from pretrain.distributed import average_buffers


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
