"""Discrete-event simulation of a pipeline schedule.

Each device runs its actions in the order given.

[Note: pipeline dependencies] An action starts when its device is free and the actions it depends
on have ended, plus the communication cost when a dependency ran on another device:
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
from collections.abc import Callable, Sequence

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

__all__ = ["ScheduleError", "SimResult", "Interval", "dependencies", "levels", "memory_levels",
           "simulate", "summarize", "timeline"]


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
    model: int = 0  # which model's, in a fused schedule [Note: fused schedules]


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
    out, copies = timeline([[(0, a) for a in ops] for ops in schedule.device_ops],
                           stages=[placement.num_stages], costs=[costs], schedule=schedule)
    chunks = placement.chunks
    return summarize(out, copies, lambda iv: memory.delta(iv.action, chunks),
                     lambda iv: memory.offloaded(chunks))


def timeline(device_ops: Sequence[Sequence[tuple[int, Action]]], *, stages: Sequence[int],
             costs: Sequence[Costs], schedule: Schedule | None = None,
             names: Sequence[str] = ()) -> tuple[list[list[Interval]], list[list[Interval]]]:
    """Each device's compute intervals and copies, running its (model, action) list in order:
    one model's actions wait for that model's own (`dependencies`), never another's, and every
    model's share a device's compute [Note: fused schedules in flowkit/planner/fused.py].
    `stages` and `costs` are each model's; `names` name the models in errors."""
    offloaded = {(m, a.stage, a.microbatch) for ops in device_ops for m, a in ops
                 if a.kind is Kind.O}
    devices = len(device_ops)
    ends: dict[tuple[int, ActionKey], float] = {}
    done_on: dict[tuple[int, ActionKey], int] = {}
    waiting: dict[tuple[int, ActionKey], list[int]] = defaultdict(list)
    cursor = [0] * devices
    free_at = [0.0] * devices
    # the last compute op's start (when the next copies are issued) and each copy engine's end
    issued = [0.0] * devices
    engine: dict[tuple[int, Kind], float] = defaultdict(float)
    out: list[list[Interval]] = [[] for _ in range(devices)]
    copies: list[list[Interval]] = [[] for _ in range(devices)]
    ready = list(range(devices))

    def named(model: int, action: Action) -> str:
        return f"{names[model]}:{action}" if names else str(action)

    while ready:
        device = ready.pop()
        ops = device_ops[device]
        while cursor[device] < len(ops):
            model, action = ops[cursor[device]]
            copy = action.kind.is_copy
            start = max(issued[device], engine[device, action.kind]) if copy else free_at[device]
            deps = dependencies(action, stages[model])
            if (action.kind in (Kind.B, Kind.BW)
                    and (model, action.stage, action.microbatch) in offloaded):
                deps.append((action.stage, Kind.P, action.microbatch))
            blocked = None
            for stage, kind, mb in deps:
                key = (model, action_key(stage, kind, mb))
                if key not in ends:
                    blocked = key
                    break
                hop = costs[model].comm if done_on[key] != device else 0.0
                start = max(start, ends[key] + hop)
            if blocked is not None:
                waiting[blocked].append(device)
                break
            end = start + costs[model].of(action)
            key = (model, action.key)
            if key in ends:
                raise ScheduleError(
                    f"{named(model, action)} runs twice: its (stage, kind, microbatch) was "
                    "already scheduled", schedule=schedule, marked=[action])
            ends[key], done_on[key] = end, device
            if copy:
                engine[device, action.kind] = end
                copies[device].append(Interval(action, start, end, model))
            else:
                free_at[device], issued[device] = end, start
                out[device].append(Interval(action, start, end, model))
            cursor[device] += 1
            ready.extend(waiting.pop(key, ()))
    stuck = [(d, ops[cursor[d]]) for d, ops in enumerate(device_ops) if cursor[d] < len(ops)]
    if stuck:
        raise ScheduleError(
            "deadlock: no device can run its next action: "
            + ", ".join(f"device {d} waits at {named(*head)}" for d, head in stuck),
            schedule=schedule, marked=[action for _, (_, action) in stuck])
    return out, copies


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
    return levels(intervals, copies, lambda iv: memory.delta(iv.action, chunks),
                  lambda iv: memory.offloaded(chunks))


def levels(intervals: Sequence[Interval], copies: Sequence[Interval],
           delta: Callable[[Interval], float],
           moved: Callable[[Interval], float]) -> list[tuple[float, Action]]:
    """`memory_levels` with what each compute op adds (`delta`) and each copy moves (`moved`)
    given per interval: several models' on a shared device each count by their own model."""
    if not copies:  # the common case: running sums in order
        level, out = 0.0, []
        for iv in intervals:
            level += delta(iv)
            out.append((level, iv.action))
        return out
    events = []
    for iv in intervals:
        change = delta(iv)
        events.append((iv.start if change > 0 else iv.end, change > 0, change, iv.action))
    for iv in copies:
        if iv.action.kind is Kind.O:
            events.append((iv.end, False, -moved(iv), iv.action))
        else:
            events.append((iv.start, True, moved(iv), iv.action))
    level, out = 0.0, []
    for _, _, change, action in sorted(events, key=lambda e: (e[0], e[1])):
        level += change
        out.append((level, action))
    return out


def summarize(out: list[list[Interval]], copies: list[list[Interval]],
              delta: Callable[[Interval], float],
              moved: Callable[[Interval], float]) -> SimResult:
    """The result of a `timeline`, memory counted by `levels` with `delta` and `moved`."""
    spans, busy, peaks = [], [], []
    for device, intervals in enumerate(out):
        spans.append(intervals[-1].end - intervals[0].start if intervals else 0.0)
        busy.append(sum(iv.end - iv.start for iv in intervals))
        changes = levels(intervals, copies[device], delta, moved)
        peaks.append(max([0.0] + [level for level, _ in changes]))
    return SimResult(intervals=tuple(tuple(iv) for iv in out),
                     makespan=max((ivs[-1].end for ivs in out if ivs), default=0.0),
                     device_span=tuple(spans), busy=tuple(busy),
                     bubble_rate=bubble_rate(spans, busy), peak_memory=tuple(peaks),
                     copies=tuple(tuple(c) for c in copies))
