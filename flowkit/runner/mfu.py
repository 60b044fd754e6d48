"""A training step's MFU: the model FLOPs its trainings ran (their executors count them: [Note:
model FLOPs in executors/torch/train/flops.py]) over the step's seconds and the peak FLOP/s of
the devices that ran them, each device's own (a known GPU's, by name) or FLOWKIT_PEAK_TFLOPS
for all (TFLOP/s of one device: a CPU has none of its own)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from flowkit.ops.peak import PEAK_TFLOPS_ENV, peak_override

__all__ = ["PEAK_TFLOPS_ENV", "mfu", "peak_override"]

def mfu(trainings: Iterable[tuple[float, Mapping[int, float | None]] | None], seconds: float,
        environ: Mapping[str, str] = os.environ) -> float | None:
    """The step's model FLOPs over `seconds` and the summed peaks of the devices that ran them
    (a device two trainings share counts once), from each training's (FLOPs, peak by executor);
    None when no FLOPs ran or a device's peak is unknown."""
    flops, peaks = 0.0, {}
    for got in trainings:
        if got is not None:
            flops += got[0]
            peaks.update(got[1])
    override = peak_override(environ)
    if override is not None:
        peaks = dict.fromkeys(peaks, override)
    if flops <= 0 or seconds <= 0 or not peaks or not all(peaks.values()):
        return None
    return flops / seconds / sum(peaks.values())
