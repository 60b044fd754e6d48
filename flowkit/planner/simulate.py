"""Discrete-event simulation of a pipeline schedule.

Each device runs its actions in the order given. An action starts when its device is free and
the actions it depends on have ended, plus the communication cost when a dependency ran on another
device. [Note: pipeline dependencies]
  F(s, mb)  after F(s-1, mb)
  B(s, mb)  after B(s+1, mb) (or its BW); on the last stage after F(s, mb)
  W(s, mb)  after B(s, mb)
BW is a B for the purpose of dependencies. Nothing else orders actions: a schedule's own order on
each device is the only other constraint. The comm cost is charged once per such edge whose two
ends run on different devices (never for W, never within a device); comm does not occupy either
device. A device's span runs from its first op's start to its last op's end, and the bubble rate
is (max span - busiest device's busy time) / max span: the Zero Bubble paper's definition, with
which these rules reproduce its Table 5 (tests/planner/test_paper_table5.py).

Offload (O) and prefetch (P) actions run on the device's copy engines, beside its compute, and
a B or BW of an offloaded microbatch waits for its prefetch [Note: offload in
flowkit/planner/offload.py]; they are not ops of the device's span or busy time.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import attrs

from flowkit.planner.ir import (
    Action,
    ActionKey,
    Costs,
    Kind,
    MemoryModel,
    Schedule,
    action_key,
    bubble_rate,
)

__all__ = ["ScheduleError", "SimResult", "Interval", "dependencies", "memory_levels", "simulate"]


class ScheduleError(ValueError):
    """A schedule that cannot run as written, or that no schedule can meet the memory limit;
    `marked` names the offending actions, `problems` lists each problem in one line (the message
    may add a rendered grid), and `over_memory` says that the memory limit is the only problem."""

    def __init__(self, message: str, *, schedule: Schedule | None = None, marked=(), problems=(),
                 over_memory: bool = False) -> None:
        self.schedule = schedule
        self.over_memory = over_memory
        self.marked = frozenset(marked)
        self.problems = tuple(problems) or (message.split("\n", 1)[0],)
        super().__init__(message)


@attrs.frozen
class Interval:
    action: Action
    start: float
    end: float


@attrs.frozen(kw_only=True)
class SimResult:
    intervals: tuple[tuple[Interval, ...], ...]  # per device, in execution order
    makespan: float
    device_span: tuple[float, ...]
    busy: tuple[float, ...]  # total op time per device
    bubble_rate: float
    peak_memory: tuple[float, ...]
    # per device, its O and P copies in the order listed [Note: offload]; empty without
    copies: tuple[tuple[Interval, ...], ...] = ()

    def to_json(self) -> dict:
        return {"makespan": self.makespan, "device_span": list(self.device_span),
                "bubble_rate": self.bubble_rate, "peak_memory": list(self.peak_memory)}


def dependencies(action: Action, num_stages: int) -> list[tuple[int, Kind | None, int]]:
    """(stage, kind, microbatch) this action waits for; kind None means "B or BW". A B or BW
    of an offloaded microbatch also waits for its P, which `simulate` adds [Note: offload]."""
    s, mb = action.stage, action.microbatch
    if action.kind is Kind.F:
        return [(s - 1, Kind.F, mb)] if s > 0 else []
    if action.kind is Kind.O:
        return [(s, Kind.F, mb)]
    if action.kind is Kind.P:
        return [(s, Kind.O, mb)]
    if action.kind is Kind.W:
        return [(s, None, mb)]
    if s == num_stages - 1:
        return [(s, Kind.F, mb)]
    return [(s + 1, None, mb)]


def simulate(schedule: Schedule, costs: Costs, memory: MemoryModel | None = None) -> SimResult:
    """Run `schedule` with per-stage `costs`; raise ScheduleError on deadlock or bad actions."""
    memory = memory or MemoryModel()
    placement = schedule.placement
    if costs.num_stages != placement.num_stages:
        raise ValueError(
            f"costs cover {costs.num_stages} stages but schedule {schedule.kind!r} has "
            f"{placement.num_stages}")
    _check_actions_placed(schedule)
    offloaded = {(a.stage, a.microbatch) for ops in schedule.device_ops for a in ops
                 if a.kind is Kind.O}
    ends: dict[ActionKey, float] = {}
    done_on: dict[ActionKey, int] = {}
    waiting: dict[ActionKey, list[int]] = defaultdict(list)
    cursor = [0] * schedule.num_devices
    free_at = [0.0] * schedule.num_devices
    # the last compute op's start (when the next copies are issued) and each copy engine's end
    issued = [0.0] * schedule.num_devices
    engine: dict[tuple[int, Kind], float] = defaultdict(float)
    out: list[list[Interval]] = [[] for _ in range(schedule.num_devices)]
    copies: list[list[Interval]] = [[] for _ in range(schedule.num_devices)]
    ready = list(range(schedule.num_devices))
    while ready:
        device = ready.pop()
        ops = schedule.device_ops[device]
        while cursor[device] < len(ops):
            action = ops[cursor[device]]
            copy = action.kind.is_copy
            start = max(issued[device], engine[device, action.kind]) if copy else free_at[device]
            deps = dependencies(action, placement.num_stages)
            if action.kind in (Kind.B, Kind.BW) and (action.stage, action.microbatch) in offloaded:
                deps.append((action.stage, Kind.P, action.microbatch))
            blocked = None
            for stage, kind, mb in deps:
                key = action_key(stage, kind, mb)
                if key not in ends:
                    blocked = key
                    break
                hop = costs.comm if done_on[key] != device else 0.0
                start = max(start, ends[key] + hop)
            if blocked is not None:
                waiting[blocked].append(device)
                break
            end = start + costs.of(action)
            key = action.key
            if key in ends:
                raise ScheduleError(
                    f"{action} runs twice: its (stage, kind, microbatch) was already scheduled",
                    schedule=schedule, marked=[action])
            ends[key], done_on[key] = end, device
            if copy:
                engine[device, action.kind] = end
                copies[device].append(Interval(action, start, end))
            else:
                free_at[device], issued[device] = end, start
                out[device].append(Interval(action, start, end))
            cursor[device] += 1
            ready.extend(waiting.pop(key, ()))
    stuck = [ops[cursor[d]] for d, ops in enumerate(schedule.device_ops) if cursor[d] < len(ops)]
    if stuck:
        raise ScheduleError(
            "deadlock: no device can run its next action: "
            + ", ".join(f"device {placement.device_of(a.stage)} waits at {a}" for a in stuck),
            schedule=schedule, marked=stuck)
    return _summarize(schedule, out, copies, memory)


def _check_actions_placed(schedule: Schedule) -> None:
    placement = schedule.placement
    for device, ops in enumerate(schedule.device_ops):
        for action in ops:
            if action.stage >= placement.num_stages:
                problem = (f"{action} names stage {action.stage}, but there are only "
                           f"{placement.num_stages} stages")
            elif placement.device_of(action.stage) != device:
                problem = (f"{action} is listed on device {device}, but stage {action.stage} "
                           f"lives on device {placement.device_of(action.stage)}")
            elif action.microbatch >= schedule.microbatches:
                problem = (f"{action} names microbatch {action.microbatch}, but the schedule "
                           f"has {schedule.microbatches} microbatches")
            else:
                continue
            raise ScheduleError(problem, schedule=schedule, marked=[action])


def memory_levels(intervals: Sequence[Interval], copies: Sequence[Interval],
                  memory: MemoryModel, chunks: int) -> list[tuple[float, Action]]:
    """A device's activation memory after each change, with the action that made it. Compute
    ops change it in their order (what the memory model counts: an addition at the op's start,
    a release at its end, which comes to the same on one device); an offload takes the F's
    share off when its copy ends and a prefetch puts it back when its copy starts
    [Note: offload]. At equal times releases come first: memory freed at t is free for an
    op that starts at t."""
    if not copies:  # the common case: running sums in order
        level, out = 0.0, []
        for iv in intervals:
            level += memory.delta(iv.action, chunks)
            out.append((level, iv.action))
        return out
    moved = memory.offloaded(chunks)
    events = []
    for iv in intervals:
        delta = memory.delta(iv.action, chunks)
        events.append((iv.start if delta > 0 else iv.end, delta > 0, delta, iv.action))
    for iv in copies:
        if iv.action.kind is Kind.O:
            events.append((iv.end, False, -moved, iv.action))
        else:
            events.append((iv.start, True, moved, iv.action))
    level, out = 0.0, []
    for _, _, delta, action in sorted(events, key=lambda e: (e[0], e[1])):
        level += delta
        out.append((level, action))
    return out


def _summarize(schedule: Schedule, out: list[list[Interval]], copies: list[list[Interval]],
               memory: MemoryModel) -> SimResult:
    chunks = schedule.placement.chunks
    spans, busy, peaks = [], [], []
    for device, intervals in enumerate(out):
        spans.append(intervals[-1].end - intervals[0].start if intervals else 0.0)
        busy.append(sum(iv.end - iv.start for iv in intervals))
        levels = memory_levels(intervals, copies[device] if copies else (), memory, chunks)
        peaks.append(max([0.0] + [level for level, _ in levels]))
    return SimResult(intervals=tuple(tuple(iv) for iv in out),
                     makespan=max((ivs[-1].end for ivs in out if ivs), default=0.0),
                     device_span=tuple(spans), busy=tuple(busy),
                     bubble_rate=bubble_rate(spans, busy), peak_memory=tuple(peaks),
                     copies=tuple(tuple(c) for c in copies))
