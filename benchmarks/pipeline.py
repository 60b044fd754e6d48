"""Pipeline benchmark: 1f1b and zb-h1 plans for p = 4, m = 16 with ops of about 2 ms, run on
simulator executor processes, against the planner's simulation of the same plan with the
communication cost and the executors' per-op time profiled in the same run. `flowkit schedule
--execute` runs one plan the same way (`execute_on_simulators`).

It submits a schedule's tasks, not a flow's steps: it stays on the Controller API, not flowkit.Run.
"""

from __future__ import annotations

from flowkit.planner import Costs
from flowkit.planner.schedules import build_schedule
from flowkit.runner.schedule_run import execute_on_simulators

__all__ = ["run_pipeline_bench"]


def run_pipeline_bench(*, kinds: tuple[str, ...] = ("1f1b", "zb-h1"), devices: int = 4,
                       microbatches: int = 16, unit_s: float = 0.002, repeats: int = 3) -> dict:
    out: dict = {"devices": devices, "microbatches": microbatches, "op_s": unit_s}
    for kind in kinds:
        costs = Costs.uniform(devices)
        schedule = build_schedule(kind, devices=devices, microbatches=microbatches, costs=costs)
        out[kind] = execute_on_simulators(schedule, costs.for_placement(schedule.placement),
                                          unit_s=unit_s, repeats=repeats)
    return out
