"""How many threads a training process computes with on the CPU.

torch sizes its intra-op pool for every core of the machine, in every process. Two ranks on one node, a Slurm job
given 4 of a node's 64 cores, or a process beside another run then ask for more threads than they have cores, and
OpenMP's team waits at every barrier for a thread whose core is taken: one ResNet-18 step on 2 cores ran 8x slower
beside a single busy process (docs/benchmarks.md, "Training step"). So a training process computes with the cores it
may use: `usable_cpus()`, or `engine.threads` when set.

    threads = configure_threads(requested=0)      # 0: usable_cpus(); OMP_NUM_THREADS, when set, is kept
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def usable_cpus(environ: dict | None = None, affinity: set[int] | None = None, machine_cpus: int | None = None) -> int:
    """The CPUs this process may compute on. Inside a Slurm job, the task's: SLURM_CPUS_PER_TASK (at most the CPUs
    it may run on). Elsewhere the CPUs it may run on (`os.sched_getaffinity`: what a container or `taskset` leave
    it); when those are the whole machine and several ranks run on this node (LOCAL_WORLD_SIZE, set by torchrun,
    deepspeed and `launch`), each rank takes its share, since nothing pinned them apart. At least 1."""
    environ = os.environ if environ is None else environ
    affinity = os.sched_getaffinity(0) if affinity is None else affinity
    machine_cpus = (os.cpu_count() or len(affinity)) if machine_cpus is None else machine_cpus
    cpus = len(affinity)
    per_task = environ.get("SLURM_CPUS_PER_TASK", "")
    if per_task.isdigit() and int(per_task) > 0:
        return max(1, min(cpus, int(per_task)))
    local_ranks = environ.get("LOCAL_WORLD_SIZE", "1")
    if local_ranks.isdigit() and int(local_ranks) > 1 and cpus >= machine_cpus:
        cpus //= int(local_ranks)
    return max(1, cpus)


def configure_threads(requested: int = 0) -> int:
    """Set torch's intra-op threads: `requested` when positive (engine.threads), else OMP_NUM_THREADS when the
    environment sets it (torchrun sets 1 for several processes), else `usable_cpus()`. Returns the number set."""
    if requested > 0:
        threads = requested
    elif os.environ.get("OMP_NUM_THREADS", "").isdigit():
        threads = int(os.environ["OMP_NUM_THREADS"])
    else:
        threads = usable_cpus()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


@contextmanager
def one_thread_on_cpu(device: torch.device) -> Iterator[None]:
    """Small CPU work (the online monitors' 128 x 512 SVD, a linear probe's step) in one thread. With OpenMP's
    threads sleeping at barriers (OMP_WAIT_POLICY=PASSIVE, pretrain/__init__.py) each of its many small parallel
    regions wakes the team: RankMe's SVD took 16.8 ms on 2 threads against 2.5 ms on one (2.7 ms on 2 spinning
    threads; 2 idle cores, 2026-11-26). On a GPU this does nothing."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
