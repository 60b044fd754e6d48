"""A schedule as JSON: the file format of ``flowkit schedule --json``.

Keys: kind, stages (devices x chunks), devices, chunks, microbatches, stage_to_device, costs (per
stage, plus comm), memory_limit, memory_model, device_ops (action text per device) and result (the
simulated makespan, device_span, busy, bubble_rate, peak_memory). A file holds what it takes to
rebuild the Schedule, Costs and MemoryModel and simulate again (tests/planner/schedule_json.py
loads one back, and checks it gives the same result).
"""

from __future__ import annotations

from typing import Any

from flowkit.planner.ir import Costs, MemoryModel, Schedule
from flowkit.planner.simulate import SimResult

__all__ = ["schedule_to_json"]


def schedule_to_json(schedule: Schedule, *, costs: Costs, memory: MemoryModel,
                     memory_limit: float | None, result: SimResult) -> dict[str, Any]:
    """`costs` are per stage of the schedule's placement (what the simulator ran with)."""
    placement = schedule.placement
    return {"kind": schedule.kind, "stages": placement.num_stages, "devices": placement.num_devices,
            "chunks": placement.chunks, "microbatches": schedule.microbatches,
            "stage_to_device": list(placement.stage_to_device), "costs": costs.to_json(),
            "memory_limit": memory_limit, "memory_model": memory.to_json(),
            "device_ops": schedule.text(),
            "result": {**result.to_json(), "busy": list(result.busy)}}
