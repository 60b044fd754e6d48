"""Offloading stashed activations to host memory between a forward and its backward, overlapped
with compute (Wan et al., "PipeOffload: Improving Scalability of Pipeline Parallelism with
Memory Optimization", 2025).

The design: [Note: offload] below.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from flowkit.planner.ir import Action, Costs, Kind, MemoryModel, Schedule
from flowkit.planner.schedules import build_schedule
from flowkit.planner.simulate import ScheduleError, SimResult, simulate
from flowkit.planner.validate import validate

__all__ = ["OFFLOAD_CHOICES", "OffloadPick", "best_with_offload", "offload_schedule",
           "offloadable"]

# [Note: offload] A schedule offloads a microbatch's activations with two actions in its device's
# list: O(s, mb), the copy of what F(s, mb) stashed to host memory, and P(s, mb), the copy back
# (prefetch) before its backward (`0F3 0O3 ... 0P3 0B3`). Actions, not a flag on the F, because
# *when* the prefetch runs is the whole trade, and as an action it has a place the validator
# checks. The searchers work on compute orders only; `offload_schedule` adds the copies to a
# finished schedule, and whatever counts compute (spans, busy time, charts) skips them. Copies
# run on the device's copy engines (one each way), never on its compute: an O waits for its F,
# a P for its O, the B or BW for its P. O follows its F at once; P goes as late as hides it; a
# microbatch with nothing between its F and its backward, or less than two copies' time, is not
# offloaded; "half" takes every other offloadable microbatch of a stage, halving every run it
# holds. Timing, memory and placement in full: docs/schedules.md, "How offload is planned".

OFFLOAD_CHOICES = ("none", "half", "all")


def offloadable(schedule: Schedule) -> list[tuple[int, int]]:
    """(stage, microbatch) pairs with at least one compute op between F and its backward on
    their device, in the order of their forwards."""
    out = []
    for ops in schedule.device_ops:
        where = {(a.stage, a.kind, a.microbatch): i for i, a in enumerate(ops)}
        for i, a in enumerate(ops):
            if a.kind is not Kind.F:
                continue
            back = _backward_index(where, a.stage, a.microbatch)
            if back is not None and back > i + 1:
                out.append((a.stage, a.microbatch))
    return out


def _backward_index(where: dict, stage: int, mb: int) -> int | None:
    for kind in (Kind.B, Kind.BW):
        if (stage, kind, mb) in where:
            return where[stage, kind, mb]
    return None


def _chosen(schedule: Schedule, which: str | Collection[tuple[int, int]], timeline: SimResult,
            costs: Costs) -> set[tuple[int, int]]:
    ends = {iv.action: iv.end for ivs in timeline.intervals for iv in ivs}
    starts = {iv.action: iv.start for ivs in timeline.intervals for iv in ivs}

    def window(s: int, mb: int) -> float:  # from the end of F to the start of the backward
        back = Action(s, Kind.B, mb) if Action(s, Kind.B, mb) in starts else Action(s, Kind.BW, mb)
        return starts[back] - ends[Action(s, Kind.F, mb)]

    eligible = [(s, mb) for s, mb in offloadable(schedule)
                if window(s, mb) >= 2 * costs.copy_of(s)]
    if not isinstance(which, str):
        return set(which) & set(eligible)
    if which not in OFFLOAD_CHOICES:
        raise ValueError(f"offload {which!r}: expected one of {', '.join(OFFLOAD_CHOICES)}")
    if which == "none":
        return set()
    if which == "all":
        return set(eligible)
    by_stage: dict[int, list[int]] = {}
    for s, mb in eligible:
        by_stage.setdefault(s, []).append(mb)
    return {(s, mb) for s, mbs in by_stage.items() for mb in sorted(mbs)[::2]}


def offload_schedule(schedule: Schedule, costs: Costs,
                     which: str | Collection[tuple[int, int]] = "all") -> Schedule:
    """`schedule` with an O after the chosen forwards and a P before their backwards
    [Note: offload]; `costs` per stage of its placement. `which`: "none", "half", "all" or
    (stage, microbatch) pairs (those that cannot be offloaded are left out)."""
    if any(a.kind.is_copy for ops in schedule.device_ops for a in ops):
        raise ValueError(f"schedule {schedule.kind!r} already has offload copies")
    timeline = simulate(schedule, costs)
    chosen = _chosen(schedule, which, timeline, costs)
    if not chosen:
        return schedule
    device_ops = []
    for ops, intervals in zip(schedule.device_ops, timeline.intervals):
        where = {(a.stage, a.kind, a.microbatch): i for i, a in enumerate(ops)}
        starts = {iv.action: iv.start for iv in intervals}
        prefetch_after: dict[int, list[tuple[int, Action]]] = {}
        for (s, mb) in chosen:
            if (s, Kind.F, mb) not in where:
                continue
            f, back = where[s, Kind.F, mb], _backward_index(where, s, mb)
            due = starts[ops[back]] - costs.copy_of(s)  # when the copy must start to be in time
            t = back - 1
            while t - 1 > f and starts[ops[t]] > due + 1e-9:
                t -= 1
            prefetch_after.setdefault(t, []).append((back, Action(s, Kind.P, mb)))
        new: list[Action] = []
        for i, a in enumerate(ops):
            new.append(a)
            if a.kind is Kind.F and (a.stage, a.microbatch) in chosen:
                new.append(Action(a.stage, Kind.O, a.microbatch))
            new.extend(p for _, p in sorted(prefetch_after.get(i, ())))
        device_ops.append(new)
    return Schedule(kind=schedule.kind, placement=schedule.placement,
                    microbatches=schedule.microbatches, device_ops=device_ops)


class OffloadPick:
    """What `best_with_offload` chose: the schedule, its simulation, and how it offloads."""

    def __init__(self, schedule: Schedule, result: SimResult, offload: str,
                 built_limit: float | None) -> None:
        self.schedule, self.result, self.offload = schedule, result, offload
        self.built_limit = built_limit  # the memory limit the compute order was built under

    def __repr__(self) -> str:
        return (f"OffloadPick({self.schedule.kind!r}, offload={self.offload!r}, "
                f"built_limit={self.built_limit}, makespan={self.result.makespan:g})")


# What `auto` with offload also tries: the handcrafted orders, whose memory offload can cut.
_AUTO_ALSO = ("zb-h2", "zb-h1", "1f1b")


def best_with_offload(kind: str, *, devices: int, microbatches: int, costs: Costs,
                      memory: MemoryModel, memory_limit: float, chunks: int | None = None,
                      build_limits: Sequence[float | None] | None = None) -> OffloadPick:
    """The least-makespan schedule of `kind` within `memory_limit` with or without offload:
    the kind built at the limit without copies, and built under looser limits (by default
    1.5 and 2 times the limit, then none: the room that half and all of the copies can make)
    with half or all of its activations offloaded; ties go to fewer copies, then lower peak.
    `auto` (one stage per device) also tries ZB-H2, ZB-H1 and 1F1B so. ScheduleError
    (`over_memory`) when none fits."""
    if build_limits is None:
        build_limits = (memory_limit, 1.5 * memory_limit, 2 * memory_limit, None)
    kinds = [kind] + list(_AUTO_ALSO if kind == "auto" and chunks in (None, 1) else ())
    best: tuple[tuple, OffloadPick] | None = None
    errors: list[str] = []
    built: dict[tuple, Schedule] = {}
    for name, limit in ((k, lim) for k in kinds for lim in dict.fromkeys(build_limits)):
        try:
            plain = build_schedule(name, devices=devices, microbatches=microbatches,
                                   costs=costs, memory=memory, memory_limit=limit,
                                   chunks=chunks if name == kind else None)
        except ScheduleError as err:
            errors.append(err.problems[0])
            continue
        if plain.device_ops in built:
            continue
        built[plain.device_ops] = plain
        stage_costs = costs.for_placement(plain.placement)
        for rank, offload in enumerate(OFFLOAD_CHOICES):
            candidate = offload_schedule(plain, stage_costs, offload)
            try:
                result = validate(candidate, stage_costs, memory, memory_limit)
            except ScheduleError as err:
                errors.append(err.problems[0])
                continue
            key = (float(f"{result.makespan:.9g}"), rank, max(result.peak_memory))
            if best is None or key < best[0]:
                best = (key, OffloadPick(candidate, result, offload, limit))
    if best is None:
        raise ScheduleError(f"no {kind} schedule fits memory_limit={memory_limit:g}, with or "
                            f"without offload: {errors[0] if errors else 'nothing built'}",
                            over_memory=True)
    return best[1]
