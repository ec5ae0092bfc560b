"""The process group and the collective checks every stage that trains uses.

`init_distributed` joins the group a launcher (torchrun, deepspeed, Slurm through `launch`) set up, or makes a
group of one for a plain `python -m ...`; the rest are collectives, to be called on every rank.
"""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
from torch import nn

# The launcher variables `init_distributed` set itself for a group of one (no launcher): `release_distributed`
# removes them again, so that a later run in the same process, or a process it starts, does not take them for a
# launcher's (they would all share one MASTER_PORT).
_VARIABLES_SET_HERE: list[str] = []


def init_distributed(device: str = "auto") -> tuple[int, int, torch.device]:
    """Join (or, for a plain `python -m pretrain`, create) the process group: NCCL on GPUs, gloo on CPUs.
    `device`: "auto" (the GPU of LOCAL_RANK when CUDA is available) or "cpu". Returns (rank, world size, this
    process's device)."""
    import deepspeed  # heavy: deepspeed (~0.4 s after torch), loaded only by a process that joins a group

    if "RANK" not in os.environ:  # no launcher: a group of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        variables = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        os.environ.update(variables)
        _VARIABLES_SET_HERE[:] = list(variables)
    cuda = torch.cuda.is_available() and device != "cpu"
    if not cuda:
        # DeepSpeed's CPU accelerator JIT-builds its shared-memory op (deepspeed_shm_comm) at the first start,
        # about 30 s under a lock in the torch extensions cache; a start killed in that window leaves the lock
        # and every later start waits on it forever. The op serves only inference_all_reduce, which training
        # never calls: mark it unavailable so that it is neither built nor loaded.
        import deepspeed.ops  # heavy: deepspeed, as in init_distributed
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def release_distributed() -> None:
    """End the process group (its communication threads end here, not during interpreter shutdown) and undo what
    `init_distributed` set up for a group of one. DeepSpeed's own call also drops the groups DeepSpeed cached,
    which a later run in this process (a pipeline, a test) would otherwise use: "Group ... is not registered"."""
    if dist.is_initialized():
        import deepspeed.comm  # heavy: deepspeed (~0.4 s after torch), needed only once a group is up
        if deepspeed.comm.is_initialized():
            deepspeed.comm.destroy_process_group()
        else:
            dist.destroy_process_group()
    for name in _VARIABLES_SET_HERE:
        os.environ.pop(name, None)
    _VARIABLES_SET_HERE.clear()


def all_ranks_agree(ok: bool) -> bool:
    """True when `ok` holds on every process (a collective: call it on every rank)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return ok
    flag = torch.tensor([1.0 if ok else 0.0])
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def finite_on_every_rank(loss: torch.Tensor) -> bool:
    """True when `loss` is finite on every process."""
    return all_ranks_agree(bool(torch.isfinite(loss.detach()).all()))


def first_non_finite_tensor(module: nn.Module) -> str | None:
    """The name of the first parameter or floating-point buffer of `module` holding NaN or inf on this process
    (ZeRO-3: this rank's partition), or None. Buffers count: BatchNorm's running statistics can overflow while
    every weight stays finite and the train-mode loss too, and then every eval-mode feature is NaN."""
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.is_floating_point() and not bool(torch.isfinite(getattr(tensor, "ds_tensor", tensor)).all()):
            return name
    return None


def parameters_finite_on_every_rank(module: nn.Module) -> bool:
    """True when no parameter or floating-point buffer of `module` holds NaN or inf on any process."""
    return all_ranks_agree(first_non_finite_tensor(module) is None)


def average_buffers(module: nn.Module) -> None:
    """All-reduce (mean) floating-point buffers such as BatchNorm running statistics: DeepSpeed broadcasts
    parameters once at start but never buffers, so without SyncBatchNorm they drift apart between ranks."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    for buffer in module.buffers():
        if buffer.is_floating_point():
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
            buffer.div_(dist.get_world_size())


def with_sync_batchnorm(module: nn.Module, device: torch.device, world_size: int, enabled: bool) -> nn.Module:
    """`module` with its BatchNorm layers made SyncBatchNorm (statistics over the global batch) when the run trains on
    GPUs in several processes and `enabled` (engine.sync_batchnorm), else `module` unchanged; never on CPUs, where
    SyncBatchNorm raises. The training loop converts the task so; a copy kept outside the task (DINO's teacher,
    s-MoCo's key encoder) must be converted with this too, or it normalises with per-process statistics while
    the student uses global ones."""
    if device.type == "cuda" and world_size > 1 and enabled:
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    return module
