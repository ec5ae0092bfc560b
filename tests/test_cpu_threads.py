"""CPU threads per training process (pretrain/runtime/cpu_threads.py): the CPUs it may use, shared by the ranks of
a node."""
import os
import subprocess
import sys
from pathlib import Path

from pretrain.runtime.cpu_threads import one_thread_on_cpu, usable_cpus

ROOT = Path(__file__).parents[1]


def test_threads_follow_the_affinity_slurm_and_the_ranks_sharing_the_node():
    machine = set(range(64))
    assert usable_cpus({}, machine, 64) == 64
    assert usable_cpus({}, {0, 1, 2, 3}, 64) == 4                           # taskset / a container: its CPUs
    assert usable_cpus({"LOCAL_WORLD_SIZE": "2"}, machine, 64) == 32         # two ranks on the whole node: half each
    assert usable_cpus({"LOCAL_WORLD_SIZE": "2"}, set(range(8)), 64) == 8    # a rank pinned to its own cores
    assert usable_cpus({"SLURM_CPUS_PER_TASK": "4", "LOCAL_WORLD_SIZE": "8"}, machine, 64) == 4   # the task's
    assert usable_cpus({"SLURM_CPUS_PER_TASK": "16"}, {0, 1}, 64) == 2       # never more than it may run on
    assert usable_cpus({"LOCAL_WORLD_SIZE": "4"}, {0, 1}, 2) == 1            # at least one


def test_a_training_process_computes_with_its_share_unless_told(monkeypatch):
    """torch's default is every core of the machine in every process; OMP_NUM_THREADS (torchrun sets 1 for several
    processes) and engine.threads win over the computed share."""
    import torch

    from pretrain.runtime.cpu_threads import configure_threads

    cores, before = len(os.sched_getaffinity(0)), torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    try:
        assert (configure_threads(0), torch.get_num_threads()) == (cores, cores)
        assert (configure_threads(3), torch.get_num_threads()) == (3, 3)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert (configure_threads(0), configure_threads(3)) == (1, 3)
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))
        assert configure_threads(0) == 1
    finally:
        torch.set_num_threads(before)


def test_every_command_sets_openmp_to_sleep_at_barriers_before_torch_loads():
    """libgomp reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once, when torch loads it: each package sets them first
    (passive after 1000 spins: a thread waiting for a partner whose core is taken soon sleeps instead of spinning),
    and a value the user set is kept."""
    script = ("import os, sys\n"
              "class SeeTorchLoad:                  # the policy at the moment torch is first imported,\n"
              "    def find_spec(self, name, path, target=None):\n"
              "        if name == 'torch':\n"
              "            print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'),\n"
              "                  'torch' in sys.modules, flush=True)\n"
              "            os._exit(0)                  # then nothing more to see: torch is not loaded\n"
              "sys.meta_path.insert(0, SeeTorchLoad())\n"
              "import {package}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    for package in ("eval.__main__", "transfer", "launch.__main__"):      # each imports pretrain first
        result = subprocess.run([sys.executable, "-c", script.format(package=package)], cwd=ROOT, env=env,
                                capture_output=True, text=True, check=True)
        assert result.stdout.split()[:3] == ["PASSIVE", "1000", "False"], (package, result.stdout)
    kept = subprocess.run([sys.executable, "-c", script.format(package="eval")], cwd=ROOT, capture_output=True,
                          text=True, check=True, env={**env, "OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "5"})
    assert kept.stdout.split()[:2] == ["ACTIVE", "5"]


def test_the_ffcv_loader_leaves_torch_threads_as_the_training_set_them(digits):
    """FFCV 1.0.2 set torch's (global) thread count to its decode workers' when it was imported, when a loader was
    built and, from its own thread, at every epoch: the fine-tuning recipes (data.num_workers 1) trained on one
    thread whatever engine.threads said."""
    import numpy as np
    import torch

    from pretrain.data.ffcv_loader import build_ffcv_loader, ffcv_batches

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        loader = build_ffcv_loader(digits / "train.beton", 32, 64, 1, drop_last=True)
        assert torch.get_num_threads() == 3
        for _ in ffcv_batches(loader, np.arange(256)):
            pass
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_the_monitors_small_cpu_work_runs_in_one_thread_and_gives_the_threads_back():
    import torch

    from pretrain.online_monitors import rankme

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        with one_thread_on_cpu(torch.device("cpu")):
            seen.append(torch.get_num_threads())
        with one_thread_on_cpu(torch.device("meta")):             # not the CPU: left alone
            seen.append(torch.get_num_threads())
        try:
            with one_thread_on_cpu(torch.device("cpu")):
                raise KeyboardInterrupt                            # a stop inside gives the threads back too
        except KeyboardInterrupt:
            seen.append(torch.get_num_threads())
        assert seen == [1, 2, 2]
        features = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
        s = torch.linalg.svdvals(features.double())
        p = s / s.sum() + 1e-7
        assert abs(rankme(features) - float(torch.exp(-(p * p.log()).sum()))) < 1e-4 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
