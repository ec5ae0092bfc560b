"""The next batch prepared while the current step trains: on a CUDA device, a side stream.

A loader that ends on the device (FFCV's canvases copied from pinned memory, then augmented on the GPU:
pretrain/data/augment.py) queues its copy and augmentation kernels where the step's kernels are queued. On the
default stream they wait for the step before them; `prepared_one_ahead` queues them on a second stream instead, one
batch ahead, so that the GPU copies and augments batch k+1 beside step k, and step k+1 waits only for its own batch
(the pattern of NVIDIA's apex `data_prefetcher`). On a CPU (or the shape-only "meta" device) there is one stream,
run in order: the loader's batches are returned as they are, and a CPU run is unchanged.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import torch


def prepared_one_ahead(batches: Iterator[Any], device: torch.device) -> Iterator[Any]:
    """`batches` themselves off CUDA; on a CUDA device the same batches, each made on a side stream one step ahead.
    Closing the returned generator closes `batches` (FFCV's decode thread is joined when the loop leaves early)."""
    if device.type != "cuda":
        return batches
    return _prepared_on_side_stream(batches, device)


def _prepared_on_side_stream(batches: Iterator[Any], device: torch.device) -> Iterator[Any]:
    side, main = torch.cuda.Stream(device), torch.cuda.current_stream(device)
    try:
        with torch.cuda.stream(side):
            upcoming = next(batches, None)
        while upcoming is not None:
            main.wait_stream(side)                      # the step reads this batch once its kernels are done
            for tensor in tensors_in(upcoming):
                if tensor.is_cuda:                      # made on the side stream, used on the main one: its memory
                    tensor.record_stream(main)          # is not reused before the step's kernels have read it
            batch = upcoming
            with torch.cuda.stream(side):
                upcoming = next(batches, None)          # the next batch's copy and augmentation, queued beside the step
            yield batch
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def tensors_in(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a batch: a tensor, or one inside lists, tuples, dicts and dataclasses (a ViewBatch)."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, (list, tuple)):
        for item in batch:
            yield from tensors_in(item)
    elif isinstance(batch, dict):
        for item in batch.values():
            yield from tensors_in(item)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for field in dataclasses.fields(batch):
            yield from tensors_in(getattr(batch, field.name))
