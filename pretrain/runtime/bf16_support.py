"""Whether a device computes bf16 natively, as torch will run it there: one rule for `engine.precision=auto` (bf16 on a
GPU that has it, `uses_bf16` in pretrain/runtime/stage.py), the training loop's warning at start-up (bf16 asked for
where it is emulated) and the tests (which run their smallest bf16 cases where it is emulated).

A GPU: `torch.cuda.is_bf16_supported(including_emulation=False)`, true from compute capability 8.0 (A100, H100, L4);
a V100 or T4, still common on clusters, emulates bf16, and there `auto` trains in fp32 (fp16 with loss scaling would
be faster there, but is not implemented: bf16 or fp32 are the precisions this project trains and tests in).

torch's CPU bf16 convolutions and matrix products go through oneDNN (and ATen's vectorised kernels). With the AVX-512
BF16 or AMX instructions they run in hardware; without them (an AVX2-only CPU such as AMD EPYC 7003 "Milan", or
Intel before Cooper Lake) oneDNN falls back to kernels that convert every element: a ResNet-18 training step under
bf16 autocast ran 24-26x slower than fp32 at batch 32 on an AVX2-only AMD EPYC, 50x at batch 256 (`python -m
pretrain.bench precision`; docs/benchmarks.md, "bf16 on a CPU without native bf16"). Capping the instruction sets torch may use (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2) puts a
faster CPU in the same place, and the answer follows them.
"""
from __future__ import annotations

import os

from pretrain.runtime.provenance import cpu_model_name

# oneDNN's ISA caps (ONEDNN_MAX_CPU_ISA, or its older name DNNL_MAX_CPU_ISA) below AVX512_CORE_BF16: with one of
# these, oneDNN emits no native bf16 instruction whatever the CPU has.
ONEDNN_CAPS_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")


def cpu_bf16_is_native() -> bool:
    """True when this CPU has AVX-512 BF16 or AMX, torch's kernels may use AVX-512 (ATEN_CPU_CAPABILITY), and
    oneDNN's ISA is not capped below AVX512_CORE_BF16 (ONEDNN_MAX_CPU_ISA / DNNL_MAX_CPU_ISA)."""
    import torch

    hardware = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    aten = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
    return hardware and aten and cap not in ONEDNN_CAPS_WITHOUT_BF16


def bf16_is_native(device) -> bool:
    """Whether `device` (a torch.device) computes bf16 natively: a CUDA GPU of compute capability 8.0 or more (torch's
    answer without emulation), a CPU by `cpu_bf16_is_native`."""
    import torch

    if device.type == "cuda":
        with torch.cuda.device(device):
            return torch.cuda.is_bf16_supported(including_emulation=False)
    return device.type == "cpu" and cpu_bf16_is_native()


def cpu_description() -> str:
    """'MODEL (torch: CAPABILITY)', e.g. 'AMD EPYC (torch: AVX2)': what the warning and the docs name."""
    import torch

    return f"{cpu_model_name() or 'this CPU'} (torch: {torch.backends.cpu.get_cpu_capability()})"


def emulated_bf16_warning(device=None) -> str:
    """The one line a run with engine.precision=bf16 prints where bf16 is not native on its device (None: the CPU)."""
    if device is not None and device.type == "cuda":
        import torch

        return (f"warning: engine.precision=bf16 on a GPU without native bf16 ({torch.cuda.get_device_name(device)}, "
                f"compute capability {'.'.join(map(str, torch.cuda.get_device_capability(device)))}: bf16 needs 8.0 "
                "or more): torch emulates it there, slower than fp32. Use engine.precision=fp32 (or auto, which picks "
                "it on this GPU).")
    return (f"warning: engine.precision=bf16 on a CPU without native bf16 ({cpu_description()}: no AVX-512 BF16 or "
            "AMX, or capped by ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA): torch emulates bf16 here, a ResNet-18 step "
            "about 25x slower than fp32 on an AVX2-only AMD EPYC (`python -m pretrain.bench precision` measures "
            "this machine). Use engine.precision=fp32 here: bf16 pays on GPUs and on CPUs with AVX-512 BF16 or AMX.")
