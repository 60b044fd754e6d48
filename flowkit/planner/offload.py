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
# (prefetch) before its backward. Why actions rather than a flag on the F: a flag says *that* a
# microbatch is offloaded but not *when* it comes back, and the when is the whole trade (too
# early and the memory is back on the device, too late and the B waits); as actions in the list
# the prefetch has a place that the validator checks (F, O, P, then the B or BW, on one device)
# and that prints and parses like any action (`0F3 0O3 ... 0P3 0B2 0B3`). The searchers
# (greedy, local search, auto) keep working on compute orders only; `offload_schedule` adds the
# copies to a finished schedule, and everything that reads a schedule skips them where it
# counts compute (spans, busy time, charts).
#
# Timing (flowkit/planner/simulate.py). Copies run on the device's copy engines, never on its
# compute: one engine for device-to-host (the O's) and one for host-to-device (the P's), each
# in the order the list gives, as a GPU's PCIe link copies both ways at once. A copy is issued
# when the compute op listed before it starts (as a runtime enqueues it beside that op), and
# starts once issued, its engine is free and its dependency has ended: an O waits for its F, a
# P for its O. The B or BW of an offloaded microbatch waits for its P; a W needs nothing more,
# as it runs after its B. A copy takes `Costs.copy` of its stage: the stage's activation bytes
# of one microbatch over the host link's bandwidth (`Costs.from_dims(host_bytes_per_s=...)`,
# Table 1's M_B per layer), so a copy delays compute only when a prefetch is not done in time.
#
# Memory (`memory_levels`). An offload takes the F's whole addition (`MemoryModel.offloaded`)
# off the device when its copy ends, and its prefetch puts it back when its copy starts; the
# B, W or BW free it as before. The device still holds a microbatch while its F runs and its O
# copies, and from its P's start to its backward.
#
# Placement (`offload_schedule`). O follows its F at once. P goes as late as hides it: after
# the last op that, in the schedule simulated without copies, starts at least a copy's time
# before the backward does (at the latest after the op just before the backward). A microbatch
# is not offloaded when nothing runs between its F and its backward on its device (the last
# stage's, mostly), or when its backward starts less than two copies after its F ends: there is
# nothing to overlap, or no time for the copy out and back, and the offload would only delay
# the backward.
#
# Which microbatches: "all" every one that can be; "half" every other one of those on each
# stage, by microbatch. Alternate ones rather than the longest stashed: a stage holds a run of
# consecutive microbatches at any time (1F1B's p - s in steady state), so alternate ones take
# half of every run, the peak's included, while the longest stashed are ZB-H2's warm-up ones,
# gone before its peak, and 1F1B's are all alike in steady state.

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
