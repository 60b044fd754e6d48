"""A simulated schedule's bubbles, each with its length, and work fitted into them.

[Note: bubbles] A pipeline schedule leaves each device idle at moments the simulator knows: before
its first action (the warm-up: device d waits for the first microbatch to reach it), between two
actions whose inputs are not ready, and after its last (the cool-down). `bubbles` lists those
slots from the simulator's timeline: device, start, end, and the actions on either side, so the
length of every slot and where it sits in the device's order are known before anything runs.

`fill` fits units of other work whose cost is predicted (reference or critic scoring of
samples, an evaluation's forwards: PipeFill's fill jobs) into the slots without moving any of the
schedule's actions: each unit, largest first, goes into the earliest slot with room left for it
(first fit decreasing), so the schedule's critical path is the same with the fill as without.
What fits nowhere is left over; run in turn instead (before or after the schedule, spread over
every device), all of the work would add its total over the devices to the makespan, the
leftover alone does when filled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from flowkit.planner.simulate import Interval, SimResult

__all__ = ["Bubble", "Filled", "Filling", "bubbles", "fill"]


@attrs.frozen
class Bubble:
    """An idle slot of `device` from `start` to `end`; `after` and `before` are the actions
    around it (None: before the device's first action, or after its last, to the makespan)."""

    device: int
    start: float
    end: float
    after: Interval | None
    before: Interval | None

    @property
    def length(self) -> float:
        return self.end - self.start


@attrs.frozen
class Filled:
    """Unit `unit` of the fill, run on `device` from `start` to `end`, inside a bubble."""

    unit: int
    device: int
    start: float
    end: float


@attrs.frozen
class Filling:
    placed: tuple[Filled, ...]  # by start time
    left: tuple[int, ...]  # units that fit no bubble, largest first
    idle: float  # the bubbles' total length
    used: float  # of it, what the placed units take

    def extra_time(self, costs: Sequence[float], devices: int) -> tuple[float, float]:
        """(in turn, filled): what the fill adds to the makespan at best when it runs before or
        after the schedule, spread evenly over the devices, all of it or only what is left."""
        return (sum(costs) / devices, sum(costs[u] for u in self.left) / devices)


def bubbles(result: SimResult, *, min_length: float = 0.0) -> list[Bubble]:
    """Every idle slot longer than `min_length` on every device from time 0 to the makespan
    [Note: bubbles], by device then time; a device with no action is one slot."""
    # a gap of float rounding between two actions that follow each other is not a slot
    floor = max(min_length, 1e-9 * max(1.0, result.makespan))
    out = []
    for device, intervals in enumerate(result.intervals):
        free_from, previous = 0.0, None
        for interval in intervals:
            if interval.start - free_from > floor:
                out.append(Bubble(device, free_from, interval.start, previous, interval))
            if interval.end >= free_from:
                free_from, previous = interval.end, interval
        if result.makespan - free_from > floor:
            out.append(Bubble(device, free_from, result.makespan, previous, None))
    return out


def fill(slots: Sequence[Bubble], costs: Sequence[float]) -> Filling:
    """Fit units of work, their predicted `costs`, into `slots` without moving any action
    [Note: bubbles]: each unit, largest first, into the earliest slot (then the lowest device)
    with room left for it."""
    for unit, cost in enumerate(costs):
        if not (math.isfinite(cost) and cost >= 0):
            raise ValueError(f"fill: unit {unit} costs {cost!r}; a cost is a finite number >= 0")
    order = sorted(slots, key=lambda s: (s.start, s.device))
    room = [slot.start for slot in order]  # where each slot's free part begins
    placed, left = [], []
    for unit in sorted(range(len(costs)), key=lambda u: (-costs[u], u)):
        cost = costs[unit]
        for index, slot in enumerate(order):
            if slot.end - room[index] >= cost:
                placed.append(Filled(unit, slot.device, room[index], room[index] + cost))
                room[index] += cost
                break
        else:
            left.append(unit)
    return Filling(placed=tuple(sorted(placed, key=lambda f: (f.start, f.device))),
                   left=tuple(left), idle=sum(s.length for s in slots),
                   used=sum(f.end - f.start for f in placed))
