"""What the torch executor does about its device beyond running ops on it: waits for its queued
kernels where a time is read [Note: device time], sets fp32 matmuls to TF32 on CUDA, and knows
the device's peak FLOP/s for MFU, and keeps cuDNN's attention out of SDPA on CUDA.

[Note: device time] CUDA kernels run asynchronously: a clock read when an op returns measures
the launches, not the work (and the next op then waits for this one's kernels, so its time is
wrong too). Each op's end waits for its device's current stream, and each profiled F/B/W for
the whole device; on the CPU nothing is queued and nothing is done.

[Note: transfers without a wait] A plain copy of a CPU tensor to a GPU (``torch.tensor(values,
device="cuda")``, ``t.to("cuda")``) synchronizes the stream: the host waits until every kernel
queued so far has run, so it cannot queue the next ones meanwhile. A copy from pinned memory with
``non_blocking=True`` is queued like a kernel instead; torch's pinned-memory allocator keeps the
block until the copy has run, so the temporary is safe to drop at once. The rollout engine moves
its token ids, positions and sampling settings this way every step.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from executors.settings import switch
from flowkit.ops.peak import PEAK_TFLOPS_ENV, peak_override

__all__ = ["CUDNN_ATTENTION_ENV", "PEAK_TFLOPS_ENV", "TF32_ENV", "build_target", "building_on",
           "configure_attention", "configure_tf32", "cuda_device", "device_clock", "make_room",
           "peak_flops", "synchronize_op", "to_device"]

TF32_ENV = "FLOWKIT_TF32"
CUDNN_ATTENTION_ENV = "FLOWKIT_CUDNN_ATTENTION"


def cuda_device(device: str | torch.device) -> str | None:
    """`device` as a CUDA device name ("cuda", "cuda:1"), or None when it is no CUDA device."""
    name = str(device)
    return name if name == "cuda" or name.startswith("cuda:") else None


def synchronize_op(ctx: Any) -> None:
    """The op-end hook of the torch executor kind [Note: device time]: wait for the kernels the
    op queued on the executor's device, on its current stream: not for a collective's own
    stream, where a weight broadcast waits for receivers whose loads start only once this op
    has ended [Note: weights by broadcast in executors/torch/weight_broadcast.py]. A process
    that never touched CUDA has none queued (and synchronizing would create a context: a
    second and hundreds of MiB)."""
    device = cuda_device(ctx.device)
    if device is not None and torch.cuda.is_initialized():
        torch.cuda.current_stream(device).synchronize()


def device_clock(device: str | torch.device) -> Callable[[], float]:
    """perf_counter, after waiting for `device`'s queued kernels on CUDA [Note: device time]."""
    cuda = cuda_device(device)
    if cuda is None:
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(cuda)
        return time.perf_counter()

    return clock


def configure_tf32(environ: Mapping[str, str] = os.environ) -> bool:
    """Let fp32 matmuls and convolutions on CUDA use TF32 tensor cores (about 8x faster on an
    A100 or H100, with a 10-bit mantissa in the products), unless FLOWKIT_TF32=0. Only CUDA's
    flags: CPU matmuls keep full fp32 (the tests compare them bit for bit). Returns the
    setting."""
    enabled = switch(environ, TF32_ENV, True)
    # the legacy flags: torch >= 2.9 maps them onto its per-backend settings, and both APIs
    # still read back after (setting the new one makes a read of the old one raise, and
    # torch.get_float32_matmul_precision, which inductor calls, with it)
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    return enabled


# [Note: no cuDNN attention] On a Hopper GPU torch's SDPA picks cuDNN's attention first, and
# cuDNN builds a graph for every new shape of q, k and v. A rollout's decode step attends over
# keys one longer than the last step's, and packed or padded microbatches change width every
# step, so nearly every call builds one. On an H200 (Qwen2.5-0.5B's shape in bf16, 64 rows,
# 128 new tokens) the engine took 97 ms a decode step with it and 26-29 ms without, and HF
# generate 8.2 s against 2.4 s (`bash tools/gpu/device_check.sh`, qwen05b_attention_backend).
# Flash and memory-efficient attention compile nothing at run time.
def configure_attention(environ: Mapping[str, str] = os.environ) -> bool:
    """Leave cuDNN out of SDPA's choices [Note: no cuDNN attention], unless
    FLOWKIT_CUDNN_ATTENTION=1. Returns whether cuDNN attention is on."""
    enabled = switch(environ, CUDNN_ATTENTION_ENV, False)
    torch.backends.cuda.enable_cudnn_sdp(enabled)
    return enabled


def make_room(ctx: Any) -> None:
    """Before a training op: each idle generation engine of this executor that can hand its
    device memory back does (vLLM's sleep: [Note: vLLM sleeps beside a trainer in
    executors/torch/rollout/vllm_engine.py]); other backgrounds are left alone."""
    for background in list(ctx.background.values()):
        release = getattr(background, "make_room", None)
        if release is not None:
            release()


# Dense bf16 tensor-core peaks, TFLOP/s, from the vendors' data sheets (the sparse figures are
# twice these). Matched in order on the device name: the more specific names first.
_PEAK_TFLOPS = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10", 125.0),
    ("RTX 4090", 165.0),
    ("V100", 125.0),  # fp16: a V100 has no bf16
    ("T4", 65.0),  # fp16
)


def peak_flops(device: str | torch.device, environ: Mapping[str, str] = os.environ,
               name: Callable[[str], str] | None = None) -> float | None:
    """The device's peak FLOP/s for MFU: FLOWKIT_PEAK_TFLOPS if set, else a known GPU's dense
    bf16 peak by its name (`name(device)`, default torch.cuda.get_device_name); None for a CPU
    or an unknown GPU."""
    given = peak_override(environ)
    if given is not None:
        return given
    cuda = cuda_device(device)
    if cuda is None or (name is None and not torch.cuda.is_available()):
        return None
    model = (name or torch.cuda.get_device_name)(cuda)
    return next((tflops * 1e12 for key, tflops in _PEAK_TFLOPS if key in model), None)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`, queued without a wait when it goes from the host to a GPU [Note:
    transfers without a wait]; `t` itself when it is there already."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# -- where a model being built will live -------------------------------------------------------
_BUILD_TARGET: contextvars.ContextVar[tuple[torch.device, torch.dtype] | None] = \
    contextvars.ContextVar("build_target", default=None)


@contextlib.contextmanager
def building_on(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Within the block, a model build that loads weights may load them onto `device` in
    `dtype` at once (`build_target`) instead of as float32 on the host, which the caller then
    casts and moves: an HF folder of a 7B model in bf16 then never holds its 28 GB float32
    copy in host memory."""
    token = _BUILD_TARGET.set((torch.device(device), dtype))
    try:
        yield
    finally:
        _BUILD_TARGET.reset(token)


def build_target() -> tuple[torch.device, torch.dtype]:
    """(device, dtype) the model being built will be moved to; the host's float32 outside
    `building_on`."""
    return _BUILD_TARGET.get() or (torch.device("cpu"), torch.float32)
