"""The machine a speed was measured on, for the benchmarks' tables: what a speed depends on besides the code."""
from __future__ import annotations

import torch


def this_machine() -> dict:
    """What a speed depends on besides the code: the machine as a run's provenance records it (CPU model, cores,
    the cores this process may use, torch's threads, GPUs), and the CPU's instruction sets as torch sees them:
    AVX-512 (avx512f), AVX-512 BF16 and AMX (bf16 in hardware), the capability ATen's kernels use (AVX2 or AVX512,
    capped by ATEN_CPU_CAPABILITY), and whether bf16 runs natively here (pretrain/runtime/bf16_support.py)."""
    from pretrain.runtime.bf16_support import cpu_bf16_is_native
    from pretrain.runtime.provenance import machine_description

    return {**machine_description(), "avx512f": torch.cpu._is_avx512_supported(),
            "avx512_bf16": torch.cpu._is_avx512_bf16_supported(), "amx": torch.cpu._is_amx_tile_supported(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": cpu_bf16_is_native()}


def machine_heading(machine: dict) -> str:
    """`this_machine()` in one line: the GPU (where the cases run on it) or the CPU and its instruction sets, then the
    cores and threads, e.g. 'AMD EPYC (avx512f: no, avx512_bf16: no, amx: no; torch: AVX2), 2 cores, 2 threads'."""
    def has(flag: str) -> str:
        return "yes" if machine[flag] else "no"

    cpu = (f"{machine['cpu'] or 'an unnamed CPU'} (avx512f: {has('avx512f')}, avx512_bf16: {has('avx512_bf16')}, "
           f"amx: {has('amx')}; torch: {machine['torch_cpu_capability']})")
    where = f"{machine['gpus'][0]}, on {cpu}" if machine["gpus"] else cpu
    return f"{where}, {machine['cpu_count']} cores, {machine['torch_threads']} threads"
