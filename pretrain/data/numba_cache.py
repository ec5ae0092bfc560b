"""Cache numba's compiled typed-dictionary functions on disk, so that importing FFCV takes 0.5 s, not 6 s.

FFCV builds a `numba.typed.Dict` when it is imported (`ffcv.fields.rgb_image.IMAGE_MODES`) and reads it when a
loader is built, which compiles numba's typed-dict functions (constructor, `__setitem__`, `__getitem__`) for
(str, int): about 5 s of compilation in every process that reads or writes a .beton (each training process,
each evaluation, each data-loading test). numba compiles them without its on-disk cache; enabling the cache
on them before FFCV is imported reuses the compiled code from numba's cache folder (next to numba's sources,
or NUMBA_CACHE_DIR), which numba invalidates itself when numba changes.
"""
from __future__ import annotations

import numba.typed.typeddict as typeddict
from numba.core.caching import NullCache


def cache_numba_typed_dict() -> None:
    """Enable numba's on-disk cache for the jitted functions of `numba.typed.typeddict`. Call it before FFCV is
    imported; calling it again does nothing."""
    for value in vars(typeddict).values():
        if isinstance(getattr(value, "_cache", None), NullCache) and hasattr(value, "enable_caching"):
            value.enable_caching()
