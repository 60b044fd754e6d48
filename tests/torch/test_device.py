"""The torch executor's device settings (executors/torch/device.py): TF32 for fp32 matmuls on
CUDA unless FLOWKIT_TF32=0, never the CPU's precision; a device's peak FLOP/s for MFU from
FLOWKIT_PEAK_TFLOPS or a known GPU's name, none for a CPU."""

from __future__ import annotations

import pytest
import torch

from executors.settings import switch
from executors.torch.device import configure_attention, configure_tf32, peak_flops


def _cuda_flags() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


@pytest.fixture
def tf32_settings():
    """The flags configure_tf32 changes, put back after the test."""
    before = _cuda_flags()
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize("env, enabled", [({}, True), ({"FLOWKIT_TF32": "1"}, True),
                                          ({"FLOWKIT_TF32": "0"}, False),
                                          ({"FLOWKIT_TF32": "off"}, False)])
def test_tf32_is_on_for_cuda_unless_turned_off(tf32_settings, env, enabled):
    cpu = torch.backends.mkldnn.matmul.fp32_precision \
        if hasattr(torch.backends.mkldnn, "matmul") else None
    assert configure_tf32(env) is enabled
    assert _cuda_flags() == (enabled, enabled)
    # both of torch's APIs still read back (inductor reads the old one)
    torch.get_float32_matmul_precision()
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        assert torch.backends.cuda.matmul.fp32_precision == ("tf32" if enabled else "ieee")
    if cpu is not None:  # CPU matmuls keep their precision
        assert torch.backends.mkldnn.matmul.fp32_precision == cpu


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H200", 989), ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756),
    ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A10", 125), ("NVIDIA L40S", 362),
    ("NVIDIA L4", 121), ("Tesla V100-SXM2-16GB", 125), ("NVIDIA GeForce GTX 1080", None),
])
def test_a_known_gpu_has_its_dense_bf16_peak(name, tflops):
    got = peak_flops("cuda:0", {}, name=lambda device: name)
    assert got == (None if tflops is None else tflops * 1e12)


def test_a_cpu_has_no_peak_unless_one_is_set():
    assert peak_flops("cpu", {}) is None
    assert peak_flops("cpu", {"FLOWKIT_PEAK_TFLOPS": "2.5"}) == 2.5e12
    assert peak_flops("cuda:0", {"FLOWKIT_PEAK_TFLOPS": "100"}, name=lambda d: "H100") == 1e14
    with pytest.raises(ValueError, match="FLOWKIT_PEAK_TFLOPS='fast' is not a positive number"):
        peak_flops("cpu", {"FLOWKIT_PEAK_TFLOPS": "fast"})


@pytest.mark.parametrize("env, enabled", [({}, False), ({"FLOWKIT_CUDNN_ATTENTION": "0"}, False),
                                          ({"FLOWKIT_CUDNN_ATTENTION": "1"}, True)])
def test_cudnn_attention_is_off_unless_asked_for(env, enabled):
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        assert configure_attention(env) is enabled
        assert torch.backends.cuda.cudnn_sdp_enabled() is enabled
        # flash and memory-efficient attention stay where they were
        assert torch.backends.cuda.flash_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.parametrize("value, default, got", [
    (None, True, True), (None, False, False), ("off", True, False), (" Yes ", False, True),
    ("banana", True, True), ("banana", False, False), ("", False, False)])
def test_an_on_off_setting_reads_the_usual_words_and_else_keeps_its_default(value, default, got):
    environ = {} if value is None else {"FLOWKIT_X": value}
    assert switch(environ, "FLOWKIT_X", default) is got
