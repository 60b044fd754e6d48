"""The planner: action IR, pipeline schedules, memory model and simulator, and the lowering of a
flow into task rules (lower.py: how each op is called, where stages fuse). Imports no torch or
zmq."""

from flowkit.planner.ir import (
    Action,
    ActionKey,
    Costs,
    Kind,
    MemoryModel,
    Placement,
    Schedule,
    action_key,
    bubble_rate,
)
from flowkit.planner.simulate import Interval, ScheduleError, SimResult, simulate
from flowkit.planner.validate import render_grid, validate

__all__ = ["Action", "ActionKey", "Costs", "Interval", "Kind", "MemoryModel", "Placement",
           "Schedule", "ScheduleError", "SimResult", "render_grid", "action_key", "bubble_rate",
           "simulate", "validate"]
