"""Which device each local executor gets, and the environment that pins it there.

[Note: one GPU per executor] A bare `cuda` gives executor i its own GPU i; `cuda:K` (for all,
or one per executor in a list, cycled) puts executors on GPU K, so several share it when asked
(colocated). As the Ray launcher does, each executor process is started with
CUDA_VISIBLE_DEVICES naming its one GPU and is told `cuda:0`: it cannot allocate on a
neighbour's GPU by accident, and NCCL and the caching allocator see one device. A run that needs
more GPUs than this machine shows is refused before any executor starts, naming both numbers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

import attrs

__all__ = ["DeviceError", "ExecutorDevice", "gpu_count", "local_devices", "wants_gpu"]

_NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")


class DeviceError(ValueError):
    """A device setting this machine cannot honour; the text says what was asked and why not."""


@attrs.frozen
class ExecutorDevice:
    """Executor i's device as it names it, and the environment its process starts with."""

    device: str  # "cpu", or "cuda:0" for a process that sees only its own GPU
    gpu: int | None = None  # which of this machine's visible GPUs it holds, for messages
    env: Mapping[str, str] = attrs.field(factory=dict)


def gpu_count(environ: Mapping[str, str] | None = None, proc: Path = _NVIDIA_PROC) -> int:
    """GPUs this process may use, without initialising CUDA here (the controller never imports
    torch): CUDA_VISIBLE_DEVICES' entries where it is set, else the NVIDIA driver's GPUs."""
    environ = os.environ if environ is None else environ
    visible = _visible_list(environ)
    if visible is not None:
        return len(visible)
    if proc.is_dir():
        return sum(1 for entry in proc.iterdir() if entry.is_dir())
    return _nvidia_smi_count()


def local_devices(spec: str, count: int, *, gpus: int | None = None,
                  environ: Mapping[str, str] | None = None) -> list[ExecutorDevice]:
    """The device of each of `count` local executors for the setting `spec` (cpu, cuda,
    cuda:K, or a comma-separated list cycled over the executors) [Note: one GPU per
    executor]; `gpus`: this machine's (counted when None). DeviceError if a GPU asked for is
    not there."""
    environ = os.environ if environ is None else environ
    entries = [d.strip() for d in spec.split(",") if d.strip()] or ["cpu"]
    wanted = [entries[i % len(entries)] for i in range(count)]
    indices = [_gpu_index(entry, i, spec) for i, entry in enumerate(wanted)]
    asked = sorted({k for k in indices if k is not None})
    if not asked:
        return [ExecutorDevice(device=entry) for entry in wanted]
    have = gpu_count(environ) if gpus is None else gpus
    if asked[-1] >= have:
        raise DeviceError(_too_few(spec, count, indices, have, environ))
    visible = _visible_list(environ) or [str(k) for k in range(have)]
    return [ExecutorDevice(device=entry) if k is None else
            ExecutorDevice(device="cuda:0", gpu=k, env={"CUDA_VISIBLE_DEVICES": visible[k]})
            for entry, k in zip(wanted, indices)]


def wants_gpu(spec: str, count: int) -> list[bool]:
    """Whether each of `count` executors asks for a GPU under `spec`, checked as
    `local_devices` checks it but without counting this machine's (a Ray cluster's are
    elsewhere)."""
    entries = [d.strip() for d in spec.split(",") if d.strip()] or ["cpu"]
    return [_gpu_index(entries[i % len(entries)], i, spec) is not None for i in range(count)]


def _gpu_index(entry: str, executor: int, spec: str) -> int | None:
    """The GPU an entry names for executor `executor` (a bare 'cuda': its own), or None."""
    if entry == "cuda":
        return executor
    if not entry.startswith("cuda:"):
        return None
    index = entry[len("cuda:"):]
    if not index.isdigit():
        raise DeviceError(f"device {entry!r} in {spec!r}: a GPU is cuda:K with K a number "
                          "(cuda:0, cuda:1), or cuda for one GPU per executor")
    return int(index)


def _too_few(spec: str, count: int, indices: list[int | None], have: int,
             environ: Mapping[str, str]) -> str:
    needed = max(k for k in indices if k is not None) + 1
    if spec.strip() == "cuda":
        hint = (f"give --device cuda:0 to share one GPU between the {count} executors "
                "(colocated), or run fewer executors (-n)")
    else:
        hint = f"name GPUs cuda:0 to cuda:{max(have - 1, 0)} only" if have else \
            "run on the CPU (--device cpu)"
    where = "CUDA_VISIBLE_DEVICES" if "CUDA_VISIBLE_DEVICES" in environ else "the driver"
    return (f"--device {spec} asks for {needed} GPU(s) for {count} executor(s) (one GPU per "
            f"executor for a bare cuda), and this machine has {have} (as {where} shows): {hint}")


def _visible_list(environ: Mapping[str, str]) -> list[str] | None:
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    entries = [v.strip() for v in value.split(",") if v.strip()]
    # CUDA stops at the first invalid entry ("-1" hides every GPU)
    kept = []
    for entry in entries:
        if entry.startswith("-"):
            break
        kept.append(entry)
    return kept


def _nvidia_smi_count() -> int:
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return 0
    try:
        out = subprocess.run([tool, "-L"], capture_output=True, text=True, timeout=10,
                             check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))
