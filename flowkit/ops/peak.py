"""FLOWKIT_PEAK_TFLOPS, the peak FLOP/s of a device for MFU where none is known by name (a CPU,
an unlisted GPU): read where the controller runs (every training device's) and in executors (their
own), parsed once here for both [Note: model FLOPs in executors/torch/train/flops.py]."""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["PEAK_TFLOPS_ENV", "peak_override"]

PEAK_TFLOPS_ENV = "FLOWKIT_PEAK_TFLOPS"


def peak_override(environ: Mapping[str, str] = os.environ) -> float | None:
    """The peak FLOP/s FLOWKIT_PEAK_TFLOPS sets (TFLOP/s of one device), or None; a value that
    is not a positive number is a ValueError naming it (a run checks it before it starts)."""
    given = environ.get(PEAK_TFLOPS_ENV, "").strip()
    if not given:
        return None
    try:
        tflops = float(given)
    except ValueError:
        tflops = float("nan")
    if not tflops > 0 or tflops == float("inf"):
        raise ValueError(f"{PEAK_TFLOPS_ENV}={given!r} is not a positive number of TFLOP/s "
                         "(one device's dense bf16 peak, e.g. 989 for an H100)")
    return tflops * 1e12
