"""FFCV path: decode every image once into a fixed square canvas, draw all views from it in torch.

`CanvasDecoder` is an FFCV decoder for `RGBImageField` that decodes each JPEG (or copies each raw image) ONCE
and stretches the WHOLE image to `canvas_size` x `canvas_size` (no crop): output uint8 (B, S, S, 3). The
views (crops, flips, colour) are then drawn by `pretrain.data.augment.augment_views` on the training device,
batched over every view of the batch; the source height / width fields give aspect ratios in source pixels.
"""
from __future__ import annotations

import queue
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from ffcv.fields.basics import IntDecoder
from ffcv.fields.rgb_image import IMAGE_MODES, SimpleRGBImageDecoder
from ffcv.libffcv import imdecode, memcpy, resize_crop
from ffcv.loader import Loader, OrderOption
from ffcv.pipeline.allocation_query import AllocationQuery
from ffcv.pipeline.compiler import Compiler
from ffcv.pipeline.state import State
from ffcv.transforms import ToTensor

from pretrain.data.writer import FIELD_NAMES


def _quiet_numba_finalizer_key_errors(unraisable, previous_hook=sys.unraisablehook) -> None:
    """Numba's dispatcher finalizer iterates an OrderedDict of compiled overloads that FFCV's threaded
    compilation can leave inconsistent; when such a dispatcher is garbage-collected the finalizer raises a
    KeyError that Python prints as "Exception ignored in ... finalize object" (nothing is lost: it only
    releases compiled code). Those, and only those, are not printed; the rest goes to the previous hook."""
    frame = unraisable.exc_traceback
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    code = frame.tb_frame.f_code if frame is not None else None
    if (isinstance(unraisable.exc_value, KeyError) and code is not None and code.co_name == "finalizer"
            and code.co_filename.endswith("numba/core/dispatcher.py")):
        return
    previous_hook(unraisable)


sys.unraisablehook = _quiet_numba_finalizer_key_errors

# The native steps the decoder compiles, looked up when a Loader is built: a test swaps in counting versions
# (with numba disabled) to prove each sample is decoded exactly once however many views are drawn.
DECODE_STEPS = {"imdecode": imdecode, "memcpy": memcpy, "resize_crop": resize_crop}


class CanvasDecoder(SimpleRGBImageDecoder):
    """Decode each image once and resize the whole of it (stretch, no crop) to a `canvas_size` square.

    Works for variable-size datasets; output is uint8 (B, canvas_size, canvas_size, 3), channels last.
    """

    def __init__(self, canvas_size: int):
        super().__init__()
        if canvas_size < 1:
            raise ValueError(f"canvas_size must be a positive number of pixels, got {canvas_size}.")
        self.canvas_size = int(canvas_size)

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, tuple[AllocationQuery, AllocationQuery]]:
        max_height = np.uint64(self.metadata["height"].max())
        max_width = np.uint64(self.metadata["width"].max())
        canvas_shape = (self.canvas_size, self.canvas_size, 3)
        uint8 = np.dtype("<u1")
        return (replace(previous_state, jit_mode=True, shape=canvas_shape, dtype=uint8),
                (AllocationQuery(canvas_shape, uint8),
                 AllocationQuery((max_height * max_width * np.uint64(3),), uint8)))

    def generate_code(self) -> Callable:
        jpg = IMAGE_MODES["jpg"]
        mem_read = self.memory_read
        sample_range = Compiler.get_iterator()
        imdecode_c = Compiler.compile(DECODE_STEPS["imdecode"])
        memcpy_c = Compiler.compile(DECODE_STEPS["memcpy"])
        resize_c = Compiler.compile(DECODE_STEPS["resize_crop"])

        def decode(batch_indices, storage, metadata, storage_state):
            destination, decoded_storage = storage
            for dst_ix in sample_range(len(batch_indices)):
                field = metadata[batch_indices[dst_ix]]
                image_data = mem_read(field["data_ptr"], storage_state)
                height = np.uint32(field["height"])
                width = np.uint32(field["width"])
                decoded = decoded_storage[dst_ix].reshape(-1)[:3 * height * width]
                if field["mode"] == jpg:
                    imdecode_c(image_data, decoded, height, width, height, width, 0, 0, 1, 1, False, False)
                else:
                    memcpy_c(image_data, decoded)
                resize_c(decoded.reshape(height, width, 3), 0, height, 0, width, destination[dst_ix])
            return destination[:len(batch_indices)]

        decode.is_parallel = True
        return decode


def check_beton_fields(path: str | Path) -> None:
    """Raise a clear error when `path` is missing or is not a .beton written by `pretrain.data`."""
    from ffcv.reader import Reader

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; write it with `python -m pretrain.data write ...` or "
                                f"`python -m pretrain.data write-digits --out-dir DIR`.")
    names = tuple(Reader(str(path)).handlers.keys())
    if names != FIELD_NAMES:
        raise ValueError(f"{path} has fields {names}, expected {FIELD_NAMES}; rewrite it with `python -m pretrain.data`.")


class ReorderableLoader(Loader):
    """An FFCV Loader whose sample order can be replaced between epochs without recompiling its pipeline.

    FFCV compiles the numba pipeline when a Loader is built (seconds); rebuilding it every epoch just to pass
    new `indices=` would pay that again. SEQUENTIAL order returns the given indices in the given order.
    """

    def set_order(self, ordered_indices: np.ndarray) -> None:
        ordered_indices = np.asarray(ordered_indices, dtype=np.uint64)
        self.indices = ordered_indices
        self.traversal_order.indices = ordered_indices
        self.first_traversal_order = ordered_indices      # what Loader.__len__ counts


def build_ffcv_loader(path: str | Path, canvas_size: int, batch_size: int, num_workers: int,
                      drop_last: bool) -> ReorderableLoader:
    """An FFCV loader over every field of a pretrain .beton, images decoded to canvases."""
    check_beton_fields(path)
    integer_pipeline = [IntDecoder(), ToTensor()]
    pipelines = {"image": [CanvasDecoder(canvas_size), ToTensor()], "label": list(integer_pipeline),
                 "index": [IntDecoder(), ToTensor()], "height": [IntDecoder(), ToTensor()],
                 "width": [IntDecoder(), ToTensor()]}
    return ReorderableLoader(str(path), batch_size=batch_size, num_workers=num_workers,
                             order=OrderOption.SEQUENTIAL, pipelines=pipelines, drop_last=drop_last,
                             indices=np.arange(1, dtype=np.uint64))


def ffcv_batches(loader: ReorderableLoader, ordered_indices: np.ndarray) -> Iterator[tuple[torch.Tensor, ...]]:
    """Iterate `loader` over `ordered_indices` in that order: (canvas uint8, label, index, height, width) per batch.

    When the caller stops early (closes this generator), FFCV's background thread is stopped and joined
    before this returns: see `stop_epoch_thread`.
    """
    if len(ordered_indices) == 0:
        return
    loader.set_order(ordered_indices)
    epoch_iterator = iter(loader)
    try:
        for canvas, label, index, height, width in epoch_iterator:
            yield canvas, label.view(-1), index.view(-1), height.view(-1), width.view(-1)
    finally:
        stop_epoch_thread(epoch_iterator)


def stop_epoch_thread(epoch_iterator, poll_s: float = 1.0) -> None:
    """Stop FFCV's background thread (its `EpochIterator`) and wait until it has ended.

    FFCV's own `close()` only asks the thread to stop: it goes on decoding until its output queue is full
    and then returns within 0.5 s. A run that stops mid-epoch (`engine.max_steps`) and exits inside that
    window leaves the thread in numba's TBB code while the interpreter shuts down, which aborts the process
    ("terminate called without an active exception", exit status -6). Waiting for it here rules that out.
    At the end of an epoch the thread's last `put(None)` has no timeout, so while it is alive with a full
    queue one batch is taken out to let it finish.
    """
    epoch_iterator.terminate_event.set()
    while epoch_iterator.is_alive():
        epoch_iterator.join(timeout=poll_s)
        if epoch_iterator.is_alive() and epoch_iterator.output_queue.full():
            try:
                epoch_iterator.output_queue.get_nowait()
            except queue.Empty:
                pass
    epoch_iterator.close()


def num_images_in(path: str | Path) -> int:
    """Number of samples in a .beton."""
    from ffcv.reader import Reader

    return int(Reader(str(path)).num_samples)
