"""Keep freed memory for reuse in this process instead of handing it back to the kernel (glibc malloc).

glibc serves every allocation above its mmap threshold (128 KB, rising to at most 32 MB) with a fresh `mmap` and
gives it back with `munmap` when freed, and PyTorch's CPU allocator keeps no cache of its own. On a CPU each
large tensor is then paid for again at every batch: a batch of 128 views of 224 x 224 px is 77 MB of floats,
about 19,000 pages, each faulted in when first written. Measured on the 2-core machine, that was half the time of
drawing the views (SimCLR 2 x 224, a batch of 64: 214 ms with glibc's default, 95 ms with this).

The commands that train (`python -m pretrain`, `python -m transfer`) and the benchmarks call it first thing.
`reuse_freed_memory()` turns glibc's mmap path off (M_MMAP_MAX = 0) and never trims the heap (M_TRIM_THRESHOLD),
so that freed blocks serve the next batch; the process then keeps the memory of its largest batch. It is what
PyTorch's CPU tuning guide gets by preloading jemalloc or tcmalloc, without a library to install.

It is opt-in: HARDVIEW_MALLOC=reuse. A two-process gloo test of the suite took 81 s with it against 74 s
without (one run each, unconfirmed; the whole suite took as long either way), and a process that keeps its peak
memory is a choice to make, not a default. The loader benchmark's CPU figures were measured with it on.
On a C library other than glibc it does nothing.

With it or without, the one batch a CPU run allocates anew at every step and fills at once, the loader's large
views, asks the kernel for 2 MB pages (`advise_huge_pages`: madvise MADV_HUGEPAGE, which transparent huge pages
honour in their default `madvise` mode): 512 times fewer page faults for the same zeroing. Measured on the 2-core
machine (`torch.empty(256, 3, 224, 224).fill_(1)`, 1 thread): 0.27 ms a view with 4 KB pages, 0.066 ms on 2 MB
pages, 0.028 ms in reused memory. Process-wide (PyTorch's THP_MEM_ALLOC_ENABLE=1, every allocation of 2 MB or more)
the same advice made the SimCLR training step slower (364 -> 244 images/s in `python -m pretrain.bench train --only
simclr`, one run each): it stays on that one batch.
"""
from __future__ import annotations

import ctypes
import os
import platform
import sys

M_TRIM_THRESHOLD = -1      # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_MAX = -4
MADV_HUGEPAGE = 14         # linux/mman.h
HUGE_PAGE = 2 << 20


def reuse_freed_memory() -> bool:
    """Apply the setting above to this process when HARDVIEW_MALLOC=reuse; True when it was applied."""
    if os.environ.get("HARDVIEW_MALLOC") != "reuse" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1))


def advise_huge_pages(tensor):
    """Advise the kernel to back the whole 2 MB pages of a CPU tensor's memory with huge pages (madvise
    MADV_HUGEPAGE; Linux, elsewhere nothing) and return the tensor. For a fresh batch written in full right after:
    its pages are then faulted in 2 MB at a time instead of 4 KB. Advice only: a kernel without transparent huge
    pages refuses it (EINVAL), which changes nothing but the speed."""
    if sys.platform == "linux":
        start = -(-tensor.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE)
    return tensor
