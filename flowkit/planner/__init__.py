"""The planner: action IR, pipeline schedules, memory model and simulator. Imports no torch or zmq."""

from flowkit.planner.ir import Action, Costs, Kind, MemoryModel, Placement, Schedule
from flowkit.planner.simulate import Interval, ScheduleError, SimResult, simulate
from flowkit.planner.validate import render_grid, validate

__all__ = [
    "Action",
    "Costs",
    "Interval",
    "Kind",
    "MemoryModel",
    "Placement",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "render_grid",
    "simulate",
    "validate",
]
