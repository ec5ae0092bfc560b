"""bf16 where a device does not compute it natively (pretrain/runtime/bf16_support.py): the detection on CPUs and GPUs,
what engine.precision=auto picks from it, and the one line a run prints."""
from pathlib import Path

import pytest
import torch

from pretrain.runtime import bf16_support
from pretrain.runtime.bf16_support import cpu_bf16_is_native
from tests import forked_runs
from tests.engine_helpers import SMALL_RESNET

CONFIG = Path(__file__).parents[1] / "configs/pretrain/simclr_digits.yaml"


@pytest.mark.parametrize("hardware, capability, cap, native", [
    (True, "AVX512", None, True),
    (True, "AVX512", "AVX512_CORE_BF16", True),
    (True, "AVX512", "avx2", False),                 # ONEDNN_MAX_CPU_ISA=AVX2 on a CPU that has it: emulated
    (True, "AVX512", "AVX512_CORE", False),
    (True, "AVX2", None, False),                     # ATEN_CPU_CAPABILITY=avx2
    (False, "AVX512", None, False),                  # AVX-512 without its BF16 extension (Skylake, Ice Lake)
    (False, "AVX2", None, False)])                   # an AVX2-only EPYC
def test_bf16_is_native_only_with_the_instructions_and_nothing_capping_them(monkeypatch, hardware, capability, cap,
                                                                             native):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: hardware)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert bf16_support.cpu_bf16_is_native() is native


@pytest.mark.parametrize("native_on_the_gpu", [True, False])
def test_auto_precision_is_bf16_on_a_gpu_with_native_bf16_and_fp32_on_an_older_gpu_and_on_cpus(monkeypatch,
                                                                                               native_on_the_gpu):
    """engine.precision=auto on a CUDA device asks torch whether it computes bf16 without emulation (an A100 or H100
    does, a V100 or T4 does not; the capability mocked here); on a CPU auto is fp32 whatever the CPU has. bf16 and
    fp32 are what they say everywhere."""
    from pretrain.runtime.stage import LoopOptions, uses_bf16

    asked = []

    def is_bf16_supported(including_emulation=True):
        asked.append(including_emulation)
        return native_on_the_gpu or including_emulation            # emulation would always say yes

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    monkeypatch.setattr(torch.cuda, "device", lambda device: __import__("contextlib").nullcontext())
    monkeypatch.setattr(bf16_support, "cpu_bf16_is_native", lambda: True)
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    options = {precision: LoopOptions(epochs=1, batch_size=1, precision=precision) for precision in ("auto", "bf16", "fp32")}
    assert uses_bf16(options["auto"], gpu) is native_on_the_gpu and asked == [False]
    assert bf16_support.bf16_is_native(gpu) is native_on_the_gpu
    assert uses_bf16(options["auto"], cpu) is False                         # a CPU with native bf16 too
    assert uses_bf16(options["bf16"], gpu) and uses_bf16(options["bf16"], cpu)
    assert not uses_bf16(options["fp32"], gpu) and not uses_bf16(options["fp32"], cpu)


def test_this_machine_answers_as_its_instructions_say():
    has = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert not cpu_bf16_is_native() or has


@pytest.mark.slow
def test_a_bf16_run_where_bf16_is_emulated_says_so_in_one_line_and_an_fp32_run_does_not(few_digits, tmp_path):
    """ONEDNN_MAX_CPU_ISA=AVX2 makes any CPU one without native bf16 for oneDNN, as an AVX2-only CPU is (and the
    step as slow: hence the small ResNet)."""
    common = ["--config", str(CONFIG), f"data.train={few_digits / 'train.beton'}", f"data.val={few_digits / 'val.beton'}",
              "engine.max_steps=1", "data.batch_size=8", "data.views.0.size=8", "data.num_workers=1",
              "engine.image_grid_every_steps=0", *SMALL_RESNET]
    emulated = {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    bf16 = forked_runs.run("pretrain", [*common, f"run_dir={tmp_path / 'bf16'}", "engine.precision=bf16"], env=emulated)
    warnings = [line for line in bf16.stderr.splitlines() if "without native bf16" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: engine.precision=bf16 on a CPU without native bf16")
    assert "engine.precision=fp32" in warnings[0]                 # what to do
    fp32 = forked_runs.run("pretrain", [*common, f"run_dir={tmp_path / 'fp32'}", "engine.precision=fp32"], env=emulated)
    assert "native bf16" not in fp32.stderr
