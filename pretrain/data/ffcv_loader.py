"""FFCV path: decode every image once into a fixed square canvas, draw all views from it in torch.

`CanvasDecoder` is an FFCV decoder for `RGBImageField` that decodes each JPEG (or copies each raw image) ONCE
and stretches the WHOLE image to `canvas_size` x `canvas_size` (no crop): output uint8 (B, S, S, 3). The
views (crops, flips, colour) are then drawn by `pretrain.data.augment.augment_views` on the training device,
batched over every view of the batch; the source height / width fields give aspect ratios in source pixels.
"""
from __future__ import annotations

import os
import queue
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import numba
import numpy as np
import torch

from pretrain.data.numba_cache import cache_ffcv_pipeline_functions, cache_numba_typed_dict

cache_numba_typed_dict()    # before FFCV's import compiles its typed Dict (5 s in every process otherwise)
_torch_threads = torch.get_num_threads()     # FFCV's import sets them to 1 (Compiler.set_num_threads(1)): put back below

from ffcv.fields.basics import IntDecoder  # noqa: E402
from ffcv.fields.rgb_image import IMAGE_MODES, CenterCropRGBImageDecoder, SimpleRGBImageDecoder  # noqa: E402
from ffcv.libffcv import imdecode, memcpy, resize_crop  # noqa: E402
from ffcv.loader import Loader, OrderOption  # noqa: E402
from ffcv.pipeline.allocation_query import AllocationQuery  # noqa: E402
from ffcv.pipeline.compiler import Compiler  # noqa: E402
from ffcv.pipeline.state import State  # noqa: E402
from ffcv.reader import Reader  # noqa: E402
from ffcv.transforms import ToTensor  # noqa: E402

from pretrain.data import DatasetError
from pretrain.data.writer import DEFAULT_MAX_SIDE, FIELD_NAMES


def _set_decode_threads(cls, n: int) -> None:
    """FFCV 1.0.2's `Compiler.set_num_threads`, without its `torch.set_num_threads(n)`: FFCV calls it when a Loader is
    built and, from its own thread, at every epoch's start, and torch's thread count is global, so the training step
    computed with `data.num_workers` threads (1 in the fine-tuning recipes) whatever `engine.threads` said. The decode
    threads are numba's, set here as FFCV sets them; torch's stay the training loop's
    (pretrain/runtime/cpu_threads.py)."""
    cls.num_threads = n if n >= 1 else os.cpu_count()
    numba.set_num_threads(cls.num_threads)


Compiler.set_num_threads = classmethod(_set_decode_threads)
cache_ffcv_pipeline_functions(Compiler)
torch.set_num_threads(_torch_threads)

FFCV_BATCHES_IN_FLIGHT = 3 + 2      # ffcv.Loader's default batches_ahead (3), plus the 2 slots its iterator adds


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
    """Decode each image once; then either resize the whole of it (stretch, no crop) to a `canvas_size` square,
    or, with `canvas_size` 0, keep it as decoded, in the top-left corner of a batch padded to the largest stored
    image (the views are then cut from the source pixels, and the host does no resize at all).

    Works for variable-size datasets; output is uint8 (B, S, S, 3), or (B, largest height, largest width, 3) with
    `canvas_size` 0, channels last (the padding is left as it is: no view reads it).
    """

    def __init__(self, canvas_size: int):
        super().__init__()
        if canvas_size < 0:
            raise ValueError(f"canvas_size must be a number of pixels, or 0 for the decoded image itself; got "
                             f"{canvas_size}.")
        self.canvas_size = int(canvas_size)

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, tuple[AllocationQuery, AllocationQuery]]:
        max_height = np.uint64(self.metadata["height"].max())
        max_width = np.uint64(self.metadata["width"].max())
        canvas_shape = ((self.canvas_size, self.canvas_size, 3) if self.canvas_size
                        else (int(max_height), int(max_width), 3))
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
        stretch = self.canvas_size > 0

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
                if stretch:
                    resize_c(decoded.reshape(height, width, 3), 0, height, 0, width, destination[dst_ix])
                else:                 # row by row: numba's 3-D slice assignment copies byte by byte
                    rows = decoded.reshape(height, width * 3)
                    for row in range(height):
                        memcpy_c(rows[row], destination[dst_ix, row].reshape(-1)[:width * 3])
            return destination[:len(batch_indices)]

        decode.is_parallel = True
        return decode


def check_beton_fields(path: str | Path):
    """Raise DatasetError, one line naming `path` and what to do, unless it is a complete .beton written by
    `python -m pretrain.data`: missing, a folder, another file type, other fields, or a partial file (a
    killed copy or write: the file ends before the samples its header records). Returns FFCV's Reader."""
    path = Path(path)
    write_it = "write one with `python -m pretrain.data write --image-folder DIR --out FILE.beton`"
    if not path.exists():
        raise DatasetError(f"{path} does not exist; {write_it} (or `python -m pretrain.data write-digits "
                           "--out-dir DIR`)")
    if path.is_dir():
        raise DatasetError(f"{path} is a folder, not a .beton; {write_it}, or read the folder with "
                           "data.backend=torchvision")
    try:
        reader = Reader(str(path))
    except Exception as error:            # FFCV asserts on the version, numpy fails on short or foreign files
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:120]
        raise DatasetError(f"{path} is not a .beton that FFCV can read ({reason}); {write_it}") from None
    names = tuple(reader.handlers.keys())
    if names != FIELD_NAMES:
        raise DatasetError(f"{path} has fields {names}, expected {FIELD_NAMES}: it was not written by "
                           f"`python -m pretrain.data`; {write_it}")
    size = path.stat().st_size
    table = reader.alloc_table
    recorded = int(reader.num_samples)
    stored = len(np.unique(table["sample_id"])) if len(table) else 0
    end = int((table["ptr"] + table["size"]).max()) if len(table) else 0
    if int(reader.header["alloc_table_ptr"]) > size or stored < recorded or end > size:
        raise DatasetError(f"{path} is incomplete: its header records {recorded} samples, but the file ends after "
                           f"{size} bytes with {stored} of them (a write or copy that was cut short); write it again")
    return reader


def stored_image_sizes(path: str | Path) -> np.ndarray:
    """The image field's metadata of a pretrain .beton: its "height" and "width" columns, one row per image."""
    return Reader(str(path)).metadata[f"f{FIELD_NAMES.index('image')}"]    # FFCV names fields f0, f1, ...


def decode_buffer_bytes(path: str | Path, batch_size: int, output_pixels: int) -> tuple[int, int, int]:
    """Bytes FFCV allocates for an epoch over `path`: every decoder slot (batches_ahead + 2 = 5 batches in
    flight) holds, per image of the batch, a buffer for the LARGEST stored image plus the output. Returns
    (bytes, largest height, largest width)."""
    metadata = stored_image_sizes(path)
    largest = int(np.argmax(metadata["height"].astype(np.int64) * metadata["width"].astype(np.int64)))
    height, width = int(metadata["height"][largest]), int(metadata["width"][largest])
    return FFCV_BATCHES_IN_FLIGHT * batch_size * (height * width * 3 + output_pixels * 3), height, width


def half_of_machine_memory() -> int:
    """Bytes: the budget a batch's buffers may take before a start is refused (the rest is the model's)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def check_decode_memory(path: str | Path, batch_size: int, output_pixels: int, budget_bytes: int | None = None) -> None:
    """Raise DatasetError when FFCV's decode buffers for `path` would take more than `budget_bytes` (default:
    half of this machine's memory), naming the largest image and the remedies."""
    needed, height, width = decode_buffer_bytes(path, batch_size, output_pixels)
    budget = half_of_machine_memory() if budget_bytes is None else budget_bytes
    if needed > budget and output_pixels > height * width:      # the size asked for, not the stored images
        side = round(output_pixels ** 0.5)
        raise DatasetError(
            f"images of {side} x {side} px in batches of {batch_size} would take {needed / 1e9:.1f} GB of decode "
            f"buffers ({FFCV_BATCHES_IN_FLIGHT} batches in flight), over {budget / 1e9:.1f} GB (half of this "
            f"machine's memory); {path} stores images of at most {height} x {width} px: ask for a smaller image "
            "size (--image-size, data.views.*.size, data.canvas_size) or a smaller batch")
    if needed > budget:
        raise DatasetError(
            f"{path}: its largest image is {height} x {width} px, and FFCV sizes every decode buffer for it: batches "
            f"of {batch_size} would take {needed / 1e9:.1f} GB ({FFCV_BATCHES_IN_FLIGHT} batches in flight), over "
            f"{budget / 1e9:.1f} GB (half of this machine's memory). Rewrite it with `python -m pretrain.data write "
            f"--image-folder DIR --out {path} --max-side {DEFAULT_MAX_SIDE}`, or lower the batch size")


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


def usable_workers(num_workers: int) -> int:
    """`num_workers` capped at the threads numba may start on this machine (its NUMBA_NUM_THREADS, the cores by
    default): FFCV asks numba for one thread per worker, and numba refuses more ("number of threads must be between
    1 and N"). The shipped ImageNet configs ask for 8; on a smaller machine they run with what there is."""
    limit = int(numba.config.NUMBA_NUM_THREADS)
    if num_workers > limit:
        print(f"data.num_workers={num_workers} is more than the {limit} threads this machine gives numba: using "
              f"{limit}", file=sys.stderr, flush=True)
        return limit
    return num_workers


def build_ffcv_loader(path: str | Path, canvas_size: int, batch_size: int, num_workers: int,
                      drop_last: bool, memory_budget_bytes: int | None = None) -> ReorderableLoader:
    """An FFCV loader over every field of a pretrain .beton, images decoded to canvases (`canvas_size` 0: as decoded,
    padded to the largest stored image; see `CanvasDecoder`). Refuses (DatasetError)
    a file that is not a complete pretrain .beton, or whose decode buffers would not fit in memory."""
    check_beton_fields(path)
    if canvas_size:
        check_decode_memory(path, batch_size, canvas_size * canvas_size, memory_budget_bytes)
    else:                                   # the output is padded to the largest stored height and width
        metadata = stored_image_sizes(path)
        padded = int(metadata["height"].max()) * int(metadata["width"].max())
        check_decode_memory(path, batch_size, padded, memory_budget_bytes)
    integer_pipeline = [IntDecoder(), ToTensor()]
    pipelines = {"image": [CanvasDecoder(canvas_size), ToTensor()], "label": list(integer_pipeline),
                 "index": [IntDecoder(), ToTensor()], "height": [IntDecoder(), ToTensor()],
                 "width": [IntDecoder(), ToTensor()]}
    return ReorderableLoader(str(path), batch_size=batch_size, num_workers=usable_workers(num_workers),
                             order=OrderOption.SEQUENTIAL, pipelines=pipelines, drop_last=drop_last,
                             indices=np.arange(1, dtype=np.uint64))


def ffcv_batches(loader: ReorderableLoader, ordered_indices: np.ndarray) -> Iterator[tuple[torch.Tensor, ...]]:
    """Iterate `loader` over `ordered_indices` in that order: (images uint8, then every integer field as a (B,)
    tensor: label, index, and height, width where the loader decodes them) per batch.

    When the caller stops early (closes this generator), FFCV's background thread is stopped and joined
    before this returns: see `stop_epoch_thread`.
    """
    if len(ordered_indices) == 0:
        return
    loader.set_order(ordered_indices)
    epoch_iterator = iter(loader)
    try:
        for image, *integers in epoch_iterator:
            yield (image, *(field.view(-1) for field in integers))
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
    return int(Reader(str(path)).num_samples)


def build_ffcv_centre_crop_loader(path: str | Path, image_size: int, crop_fraction: float, batch_size: int,
                                  num_workers: int) -> ReorderableLoader:
    """An FFCV loader of evaluation crops: uint8 (B, S, S, 3) centre crops (FFCV's CenterCropRGBImageDecoder:
    the centred square of side crop_fraction * shorter side, resized to S), labels and indices."""
    check_beton_fields(path)
    check_decode_memory(path, batch_size, image_size * image_size)
    pipelines = {"image": [CenterCropRGBImageDecoder((image_size, image_size), ratio=crop_fraction), ToTensor()],
                 "label": [IntDecoder(), ToTensor()], "index": [IntDecoder(), ToTensor()], "height": None,
                 "width": None}
    return ReorderableLoader(str(path), batch_size=batch_size, num_workers=usable_workers(num_workers),
                             order=OrderOption.SEQUENTIAL,
                             pipelines=pipelines, drop_last=False, indices=np.arange(1, dtype=np.uint64))
