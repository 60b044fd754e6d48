"""Schedule registry: kind name -> builder, and the one entry point that builds and validates.

A builder is a pure function ``(ScheduleRequest) -> Schedule``. It receives costs per device share
(what a user profiles: one device's slice of the model) and decides its own placement; the registry
maps those costs onto the placement's stages and runs `validate` on every schedule it hands out, so
no builder can return a schedule that deadlocks, skips an op or breaks the memory limit.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from flowkit.planner.ir import Costs, MemoryModel, Schedule
from flowkit.planner.validate import validate

__all__ = ["Builder", "ScheduleRequest", "ScheduleSpec", "build_schedule", "get_spec", "register",
           "schedule_kinds"]


@attrs.frozen(kw_only=True)
class ScheduleRequest:
    """What a builder is asked for; `chunks` is already resolved against the spec."""

    kind: str
    devices: int
    microbatches: int
    chunks: int
    costs: Costs  # one entry per device share, not per stage
    memory: MemoryModel
    memory_limit: float | None  # peak activation memory per device, MemoryModel units


Builder = Callable[[ScheduleRequest], Schedule]


@attrs.frozen(kw_only=True)
class ScheduleSpec:
    name: str
    build: Builder
    summary: str
    chunks: tuple[int, ...] | None  # allowed stages per device; None means any >= 1
    default_chunks: int

    def resolve_chunks(self, chunks: int | None) -> int:
        if chunks is None:
            return self.default_chunks
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        if self.chunks is not None and chunks not in self.chunks:
            allowed = ", ".join(map(str, self.chunks))
            raise ValueError(f"schedule {self.name!r} supports chunks = {allowed}, got {chunks}")
        return chunks


_REGISTRY: dict[str, ScheduleSpec] = {}


def register(name: str, *, chunks: tuple[int, ...] | None = (1,),
             default_chunks: int | None = None) -> Callable[[Builder], Builder]:
    """Decorator adding a builder under `name`; its docstring's first line is its summary.

    `chunks` lists the stages-per-device counts it can build (None: any); `default_chunks` is
    used when the caller gives none (defaults to the first allowed count).
    """

    def decorate(build: Builder) -> Builder:
        if name in _REGISTRY:
            raise ValueError(f"schedule kind {name!r} is already registered")
        default = default_chunks if default_chunks is not None else (chunks or (1,))[0]
        doc = (build.__doc__ or "").strip().splitlines()
        _REGISTRY[name] = ScheduleSpec(name=name, build=build, summary=doc[0] if doc else "",
                                       chunks=chunks, default_chunks=default)
        return build

    return decorate


def schedule_kinds() -> list[str]:
    """Registered kind names, in registration order (handcrafted first)."""
    return list(_REGISTRY)


def get_spec(kind: str) -> ScheduleSpec:
    try:
        return _REGISTRY[kind]
    except KeyError:
        known = ", ".join(_REGISTRY)
        raise ValueError(f"unknown schedule kind {kind!r}; known kinds: {known}") from None


def build_schedule(
        kind: str, *, devices: int, microbatches: int, costs: Costs,
        memory_limit: float | None = None,
        memory: MemoryModel = MemoryModel(),  # noqa: B008 - frozen, so sharing it is safe
        chunks: int | None = None) -> Schedule:
    """Build schedule `kind` and validate it; ValueError for inputs the kind cannot take,
    ScheduleError (a ValueError too) for a schedule that fails validation."""
    spec = get_spec(kind)
    if devices < 1 or microbatches < 1:
        raise ValueError(f"devices and microbatches must be >= 1, got devices={devices}, "
                         f"microbatches={microbatches}")
    if costs.num_stages != devices:
        raise ValueError(
            f"costs are given for {costs.num_stages} device shares but devices={devices}")
    request = ScheduleRequest(kind=kind, devices=devices, microbatches=microbatches,
                              chunks=spec.resolve_chunks(chunks), costs=costs, memory=memory,
                              memory_limit=memory_limit)
    schedule = spec.build(request)
    if schedule.num_devices != devices or schedule.microbatches != microbatches:
        raise ValueError(
            f"builder for {kind!r} returned {schedule.num_devices} devices and "
            f"{schedule.microbatches} microbatches for a request of {devices} and {microbatches}")
    validate(schedule, costs.for_placement(schedule.placement), memory=memory,
             memory_limit=memory_limit)
    return schedule
