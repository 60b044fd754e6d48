"""What a step reports of a trained model's devices, asked of its executors after the step's
ops: peak activation memory and model FLOPs (stepreport.py puts them in the step's metrics)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flowkit.runner.mfu import peak_override
from flowkit.runner.pipeline import device_lane

if TYPE_CHECKING:
    from flowkit.runner.model_training import ModelTraining

__all__ = ["activation_memory", "model_flops"]


# [Note: activation memory reports] A backprop told how to offload (its config's `offload`,
# "none" included: the baseline to compare with) has its pipeline ops note the activation
# memory they hold (`track_memory`), and after each step every device of the model says its
# peak since the step before (the `activation_memory` op, in the device's lane, so after
# the step's ops): torch executors in bytes by the StageRunner's accounting, the simulator
# in microbatch stashes of the planner's memory model. The step reports the most of any
# device, as `MODEL/peak_activation_UNIT`, and each device's (over replicas), as
# `MODEL/peak_activation_UNIT/deviceD`: the last stage, which has nothing to offload in
# most schedules, often holds the most.
def activation_memory(training: ModelTraining, timeout: float) -> dict[str, float]:
    """This step's peak activation memory of the model's devices, by unit, where its
    backprop tracks it and its executors implement `activation_memory`."""
    if not training.tracked or training.trained is None:
        return {}
    schedule = training.trained[0]
    futures = []
    for replica in range(training.replicas):
        for device, info in enumerate(training.replica(replica)):
            if device >= schedule.num_devices or "activation_memory" not in info.ops:
                continue
            futures.append((device, training.ctl.submit(
                "activation_memory", config={"model": training.model.name, "reset": True},
                executor=info.id, lane=device_lane(training.lane_for(replica), device),
                meta={"node": "activation_memory", "step": training.step})))
    peaks: dict[str, float] = {}
    for device, future in futures:
        got = future.result(timeout=timeout)
        name = f"{training.model.name}/peak_activation_{got['unit']}"
        for key in (name, f"{name}/device{device}"):
            peaks[key] = max(peaks.get(key, 0.0), float(got["peak"]))
    return peaks

def model_flops(training: ModelTraining, timeout: float
                ) -> tuple[float, dict[int, float | None]] | None:
    """This step's model FLOPs on the model's devices and each device's peak FLOP/s, by
    executor [Note: model FLOPs in executors/torch/train/flops.py]; None where its
    executors cannot say, or said on the first step that no device knows its peak and no
    FLOWKIT_PEAK_TFLOPS sets one (no MFU to make: not asked again)."""
    if training.trained is None or training.flops_unknown:
        return None
    schedule, asked = training.trained[0], {}
    for replica in range(training.replicas):
        for device, info in enumerate(training.replica(replica)):
            if device < schedule.num_devices and "model_flops" in info.ops \
                    and info.id not in asked:
                asked[info.id] = training.ctl.submit(
                    "model_flops", config={"model": training.model.name, "reset": True},
                    executor=info.id, lane=device_lane(training.lane_for(replica), device),
                    meta={"node": "model_flops", "step": training.step})
    got = {executor: future.result(timeout=timeout) for executor, future in asked.items()}
    counted = [g["flops"] for g in got.values() if g["flops"] is not None]
    peaks = {executor: g["peak_flops"] for executor, g in got.items()}
    if not counted or not any(peaks.values()) and peak_override() is None:
        training.flops_unknown = True
        return None
    return sum(counted), peaks
