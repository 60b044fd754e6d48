"""Pipeline schedules by name: ``build_schedule("zb-h1", devices=4, microbatches=8, costs=...)``.

Each builder module registers its kinds with `register` when imported. Optional modules (the V
shapes and the memory-limited `auto` search) are imported if present, so adding one needs no edit
here beyond its name in `_OPTIONAL`.
"""

from __future__ import annotations

import importlib
import importlib.util

from flowkit.planner.schedules import handcrafted, interleaved  # noqa: F401 - registers kinds
from flowkit.planner.schedules.registry import (
    Builder,
    ScheduleRequest,
    ScheduleSpec,
    build_schedule,
    get_spec,
    register,
    schedule_kinds,
)

__all__ = ["Builder", "ScheduleRequest", "ScheduleSpec", "build_schedule", "get_spec", "register",
           "schedule_kinds"]

# Imported after the handcrafted kinds so `auto` can build and compare them.
_OPTIONAL = ("vshape", "auto")

for _name in _OPTIONAL:
    if importlib.util.find_spec(f"{__name__}.{_name}") is not None:
        importlib.import_module(f"{__name__}.{_name}")
