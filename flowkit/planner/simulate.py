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
"""

from __future__ import annotations

from collections import defaultdict

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

__all__ = ["ScheduleError", "SimResult", "Interval", "dependencies", "simulate"]


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

    def to_json(self) -> dict:
        return {"makespan": self.makespan, "device_span": list(self.device_span),
                "bubble_rate": self.bubble_rate, "peak_memory": list(self.peak_memory)}


def dependencies(action: Action, num_stages: int) -> list[tuple[int, Kind | None, int]]:
    """(stage, kind, microbatch) this action waits for; kind None means "B or BW"."""
    s, mb = action.stage, action.microbatch
    if action.kind is Kind.F:
        return [(s - 1, Kind.F, mb)] if s > 0 else []
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
    ends: dict[ActionKey, float] = {}
    done_on: dict[ActionKey, int] = {}
    waiting: dict[ActionKey, list[int]] = defaultdict(list)
    cursor = [0] * schedule.num_devices
    free_at = [0.0] * schedule.num_devices
    out: list[list[Interval]] = [[] for _ in range(schedule.num_devices)]
    ready = list(range(schedule.num_devices))
    while ready:
        device = ready.pop()
        ops = schedule.device_ops[device]
        while cursor[device] < len(ops):
            action = ops[cursor[device]]
            start = free_at[device]
            blocked = None
            for stage, kind, mb in dependencies(action, placement.num_stages):
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
            free_at[device] = end
            out[device].append(Interval(action, start, end))
            cursor[device] += 1
            ready.extend(waiting.pop(key, ()))
    stuck = [ops[cursor[d]] for d, ops in enumerate(schedule.device_ops) if cursor[d] < len(ops)]
    if stuck:
        raise ScheduleError(
            "deadlock: no device can run its next action: "
            + ", ".join(f"device {placement.device_of(a.stage)} waits at {a}" for a in stuck),
            schedule=schedule, marked=stuck)
    return _summarize(schedule, out, memory)


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


def _summarize(schedule: Schedule, out: list[list[Interval]], memory: MemoryModel) -> SimResult:
    chunks = schedule.placement.chunks
    spans, busy, peaks = [], [], []
    for intervals in out:
        spans.append(intervals[-1].end - intervals[0].start if intervals else 0.0)
        busy.append(sum(iv.end - iv.start for iv in intervals))
        level = peak = 0.0
        for iv in intervals:
            level += memory.delta(iv.action, chunks)
            peak = max(peak, level)
        peaks.append(peak)
    return SimResult(intervals=tuple(tuple(iv) for iv in out),
                     makespan=max((ivs[-1].end for ivs in out if ivs), default=0.0),
                     device_span=tuple(spans), busy=tuple(busy),
                     bubble_rate=bubble_rate(spans, busy), peak_memory=tuple(peaks))
