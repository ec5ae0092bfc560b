"""The torchvision backend's DataLoader workers start from a clean process, whatever the caller holds.

A worker forked from the caller inherits the caller's memory as it is at the fork: a suite run hung for good when a
worker's garbage collector freed a gloo process group an earlier in-process run had dropped
(`ProcessGroupGloo::~ProcessGroupGloo` -> `pthread_cond_broadcast` on a lock no thread of the child would ever
release). The workers now start from multiprocessing's forkserver (pretrain/data/torchvision_loader.py:
`worker_context`). The tests recreate that state, a dropped process group that only the garbage collector frees and
a live thread, with a dataset whose first read in each worker runs the collector there, 20 times over.
"""
import gc
import threading

import pytest
import torch
import torch.distributed as dist

from pretrain.data.loader import build_image_loader
from pretrain.data.torchvision_loader import worker_batches, worker_context


class CollectingImages(torch.utils.data.Dataset):
    """Four images; the first read in each worker runs the garbage collector there (where an inherited process group
    that only a collection frees would run its destructor). Once is enough: the first collection frees whatever the
    worker inherited, and each one scans the forkserver's preloaded modules (0.1-0.3 s in the suite)."""

    collected = False           # each worker reads its own copy of the dataset

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        if not self.collected:
            self.collected = True
            gc.collect()
        return torch.full((3, 4, 4), float(index)), index


def drop_a_gloo_process_group(store_path) -> None:
    """Create a one-process gloo group, destroy it, and leave its object in a reference cycle: only a garbage
    collection frees it (what an in-process run leaves behind)."""
    dist.init_process_group("gloo", store=dist.FileStore(str(store_path), 1), rank=0, world_size=1)
    cycle = {"group": dist.distributed_c10d._get_default_group()}
    cycle["self"] = cycle
    dist.destroy_process_group()
    del cycle


@pytest.fixture
def a_dropped_group_and_a_live_thread(tmp_path):
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="a live thread", daemon=True)
    thread.start()
    gc.disable()                     # the group stays unfreed in this process until the workers have forked
    try:
        yield tmp_path
    finally:
        gc.enable()
        gc.collect()
        stop.set()
        thread.join(5)


def test_the_workers_start_from_the_forkserver():
    assert worker_context().get_start_method() == "forkserver"


@pytest.mark.parametrize("repeat", range(20))
def test_workers_started_beside_a_dropped_process_group_and_a_live_thread_finish(a_dropped_group_and_a_live_thread,
                                                                                  repeat):
    drop_a_gloo_process_group(a_dropped_group_and_a_live_thread / f"store{repeat}")
    batches = list(worker_batches(CollectingImages(), 2, batch_size=2))
    assert sorted(int(index) for _, indices in batches for index in indices) == [0, 1, 2, 3]


def test_the_evaluation_loader_of_an_image_folder_finishes_beside_a_dropped_process_group(
        a_dropped_group_and_a_live_thread):
    from PIL import Image

    folder = a_dropped_group_and_a_live_thread / "images"
    for name in ("a", "b"):
        (folder / name).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (12, 10), (i * 80, 40, 40)).save(folder / name / f"{i}.png")
    drop_a_gloo_process_group(a_dropped_group_and_a_live_thread / "store")
    loader = build_image_loader(folder, 8, 4, num_workers=2)
    indices = [int(index) for _, _, batch in loader for index in batch]
    assert indices == list(range(6))
