"""Cache numba's compiled code on disk where it is the same in every process: numba's typed-dictionary functions,
so that importing FFCV takes 0.5 s, not 6 s, and FFCV's integer decoders, crop boxes and page reader (about 1 s a
loader).

FFCV builds a `numba.typed.Dict` when it is imported (`ffcv.fields.rgb_image.IMAGE_MODES`) and reads it when a
loader is built, which compiles numba's typed-dict functions (constructor, `__setitem__`, `__getitem__`) for
(str, int): about 5 s of compilation in every process that reads or writes a .beton (each training process,
each evaluation, each data-loading test). numba compiles them without its on-disk cache; enabling the cache
on them before FFCV is imported reuses the compiled code from numba's cache folder (next to numba's sources,
or NUMBA_CACHE_DIR), which numba invalidates itself when numba changes.
"""
from __future__ import annotations

import numba
import numba.typed.typeddict as typeddict
from numba.core.caching import NullCache


def cache_numba_typed_dict() -> None:
    """Enable numba's on-disk cache for the jitted functions of `numba.typed.typeddict`. Call it before FFCV is
    imported; calling it again does nothing."""
    for value in vars(typeddict).values():
        if isinstance(getattr(value, "_cache", None), NullCache) and hasattr(value, "enable_caching"):
            value.enable_caching()


# FFCV's functions whose compiled code is the same in every process: plain numpy on their arguments, no closure, no
# ctypes call (whose compiled code holds the address of FFCV's library in this process), never compiled parallel.
# (module, qualified name)
CACHEABLE_FFCV_FUNCTIONS = {("ffcv.fields.basics", "BasicDecoder.generate_code.<locals>.decoder"),   # int, float fields
                            ("ffcv.fields.rgb_image", "get_center_crop"),          # the evaluation crop's box
                            ("ffcv.memory_managers.os_cache",                      # a sample's bytes by its address
                             "OSCacheManager.compile_reader.<locals>.read")}


def cache_ffcv_pipeline_functions(compiler) -> None:
    """Compile the functions of CACHEABLE_FFCV_FUNCTIONS with numba's on-disk cache when FFCV's `compiler`
    (ffcv.pipeline.compiler.Compiler) compiles them: FFCV's own options (`Compiler.compile`: fastmath, nogil, numpy's
    error model, not parallel), `cache=True` added. FFCV compiles every function of a loader's pipeline anew for
    each loader, without the cache: a training loader's four integer decoders took 0.5 s of its 1.3 s of
    compilation, an evaluation loader's two and its crop box 0.4 s of 0.9 s, and the page reader (compiled at once
    for its signature when the loader is built) 0.5-0.8 s more, in every process: a forked one-step SimCLR run's
    main() went from 1.74 s to 1.22 s with the reader cached, on the AVX-512 EPYC. The image decoders are closures
    over the loader's memory reader and call FFCV's C library: numba cannot cache them, and they keep FFCV's
    behaviour. Where numba finds no writable cache folder, FFCV compiles them itself. Called once, where
    pretrain/data/ffcv_loader.py imports FFCV."""
    compile_uncached = compiler.compile.__func__

    def compile_with_cache(cls, code, signature=None):
        name = (getattr(code, "__module__", None), getattr(code, "__qualname__", None))
        if cls.is_enabled and name in CACHEABLE_FFCV_FUNCTIONS and not getattr(code, "is_parallel", False):
            try:
                return numba.njit(signature, fastmath=True, nogil=True, error_model="numpy", cache=True)(code)
            except RuntimeError:        # numba found no writable cache folder
                pass
        return compile_uncached(cls, code, signature)

    compiler.compile = classmethod(compile_with_cache)
