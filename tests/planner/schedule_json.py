"""A `flowkit schedule --json` file loaded back (flowkit/planner/export.py writes it): what the
tests check the format against, a round trip that must simulate to the same result. Only the
tests read the format back, so the loader lives here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from flowkit.planner.ir import Action, Costs, MemoryModel, Placement, Schedule

__all__ = ["LoadedSchedule", "schedule_from_json"]


@attrs.frozen(kw_only=True)
class LoadedSchedule:
    schedule: Schedule
    costs: Costs  # per stage
    memory: MemoryModel
    memory_limit: float | None
    result: Mapping[str, Any]  # as stored; re-simulate to check it


def _field(data: Mapping[str, Any], key: str) -> Any:
    try:
        return data[key]
    except (KeyError, TypeError):
        raise ValueError(f"schedule JSON has no {key!r} key") from None


def schedule_from_json(data: Mapping[str, Any]) -> LoadedSchedule:
    """Inverse of `schedule_to_json`; ValueError naming the key or action that is wrong."""
    placement = Placement(_field(data, "stage_to_device"))
    if _field(data, "stages") != placement.num_stages:
        raise ValueError(
            f"'stages' is {data['stages']} but stage_to_device lists {placement.num_stages}")
    costs = _field(data, "costs")
    memory = _field(data, "memory_model")
    schedule = Schedule(
        kind=_field(data, "kind"), placement=placement,
        microbatches=int(_field(data, "microbatches")),
        device_ops=[[Action.parse(t) for t in ops] for ops in _field(data, "device_ops")])
    limit = data.get("memory_limit")
    return LoadedSchedule(
        schedule=schedule,
        costs=Costs(F=_field(costs, "F"), B=_field(costs, "B"), W=_field(costs, "W"),
                    comm=costs.get("comm", 0.0), per_op=costs.get("per_op", 0.0),
                    copy=costs.get("copy", ())),
        memory=MemoryModel(**{k: float(memory[k]) for k in ("F", "B", "W", "BW") if k in memory}),
        memory_limit=None if limit is None else float(limit), result=data.get("result", {}))
