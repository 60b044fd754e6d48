"""Bubble filling: a step's scoring runs on the training executors inside their pipeline's
bubbles, sized to fit.

[Note: bubble filling] `flowkit run --fill-bubbles` (RunConfig.fill_bubbles). A pipeline
schedule leaves each training executor idle at moments the planner knows ([Note: bubbles] in
flowkit/planner/bubbles.py): the warm-up before its first action, the slots where an action
waits for another device's, the cool-down. Scoring of the step's samples (an op whose class
declares `scores`: reference log-probs, values, a reward model's scores) that waits for its own
executors (its items held while two of its tasks an executor are on the way, [Note: batched
per-item calls] in steprun.py) is lent those slots as they open:

- when a pipeline is planned, each device's bubbles are taken from the simulation of its
  schedule, with the planned costs: each opens when the action before it ends (the executor's
  own end time of the task);
- a warm-up bubble (device d waits for the first forward to come through the stages before
  it) is lent while the pipeline waits for its first microbatch, again each time a filler
  there ends: however soon the microbatch comes, device d's first action cannot start sooner
  than the bubble's length after it (a fused step waits for its first groups to be scored,
  which is when its trainers idle most);
- as one opens, the open steps' held scoring items go to that executor as one batched task
  (oldest step first), as many as the bubble's time left holds at the node's cost per item,
  learned from its batched tasks (none before one has ended: a first bubble lends nothing);
- an explicit executor skips the op's tags: what is lent is the training executor's time,
  and on torch it loads the scoring model whole there (memory the user gives it by asking).

The pipeline's actions are submitted as before and never wait for a filler that keeps to its
predicted time, so the schedule's critical path is unchanged; what the scoring gains is the
training executors' idle time. Bubbles are those of the plan: a step whose microbatches arrive
late (a fused step waiting for samples) idles more than planned, and that time is not lent.
Not with data-parallel replicas or fused models (their lanes are shared), where no bubble is
planned.
"""

from __future__ import annotations

import functools
import queue
import time
from collections.abc import Callable, Sequence
from typing import Any

from flowkit.planner import Action, ActionKey, Costs, Schedule, simulate
from flowkit.planner.bubbles import bubbles
from flowkit.runtime.registry import ExecutorInfo

__all__ = ["BubbleFill"]

_ALPHA = 0.5  # weight of a batch's newest cost per item in the moving average


class BubbleFill:
    """A run's lending of its training executors' bubbles [Note: bubble filling]. `fill(executor,
    seconds)` is the runner's: it gives the open steps' held scoring items to `executor` for
    `seconds`, returning the futures that end each task it sent (none: nothing fitted)."""

    def __init__(self, events: queue.SimpleQueue,
                 fill: Callable[[int, float], list]) -> None:
        self.events, self._fill = events, fill
        self.item_seconds: dict[str, float] = {}  # node -> predicted seconds an item
        # executor -> (length, whether its pipeline started) of a warm-up bubble being lent,
        # and those whose fillers are running
        self.warm_ups: dict[int, tuple[float, Callable[[], bool]]] = {}
        self.lent: set[int] = set()

    def plan(self, schedule: Schedule, costs: Costs, executors: Sequence[ExecutorInfo],
             started: Callable[[], bool]) -> dict[ActionKey, tuple[int, float]]:
        """The bubbles of `schedule` on `executors` by the action that opens each: (executor id,
        planned length); the warm-up ones are lent until `started()` says the pipeline's first
        action went out."""
        opened_by = {}
        for slot in bubbles(simulate(schedule, costs)):
            executor = executors[slot.device].id
            if slot.after is None:
                if slot.before is not None:  # not a device with no action at all
                    self._warm_up(executor, slot.length, started)
            else:
                opened_by[slot.after.action.key] = (executor, slot.length)
        return opened_by

    def _warm_up(self, executor: int, length: float, started: Callable[[], bool]) -> None:
        """Lend a warm-up bubble while the pipeline has not started: now, each time the fillers
        it took end, and when scoring comes to wait while it has none (`waiting_items`)."""
        self.warm_ups[executor] = (length, started)
        self.events.put(functools.partial(self._lend_warm_up, executor))

    def _lend_warm_up(self, executor: int) -> None:
        entry = self.warm_ups.get(executor)
        if entry is None or executor in self.lent:
            return
        length, started = entry
        if started():
            del self.warm_ups[executor]
            return
        ends = self._fill(executor, length)
        if ends:  # lent again once the last of them ends
            self.lent.add(executor)
            ends[-1].add_done_callback(lambda _: self.events.put(
                functools.partial(self._filler_ended, executor)))

    def _filler_ended(self, executor: int) -> None:
        self.lent.discard(executor)
        self._lend_warm_up(executor)

    def waiting_items(self) -> None:
        """Scoring items came to wait: the warm-up bubbles lent nothing may take them now."""
        for executor in list(self.warm_ups):
            if executor not in self.lent:
                self.events.put(functools.partial(self._lend_warm_up, executor))

    def watch(self, opened_by: dict[ActionKey, tuple[int, float]], action: Action,
              future: Any) -> None:
        """Lend the bubble `action` opens, if any, when its task ends."""
        slot = opened_by.get(action.key)
        if slot is not None:
            future.add_done_callback(functools.partial(self._ended, *slot))

    def _ended(self, executor: int, length: float, future: Any) -> None:
        if future.exception() is None and future.timing is not None:
            self.opened(executor, length, future.timing[1])

    def opened(self, executor: int, length: float, since: float) -> None:
        """A bubble of `length` seconds on `executor` from `since` (wall clock): any thread;
        the runner fills it between two reactions."""
        self.events.put(functools.partial(self._lend, executor, length, since))

    def _lend(self, executor: int, length: float, since: float) -> None:
        left = length - max(0.0, time.time() - since)
        if left > 0:
            self._fill(executor, left)

    def learn(self, node: str, seconds: float, items: int) -> None:
        """A batched task of `node` took `seconds` for `items` items."""
        if items > 0 and seconds >= 0:
            per_item = seconds / items
            old = self.item_seconds.get(node)
            self.item_seconds[node] = per_item if old is None else (
                _ALPHA * per_item + (1 - _ALPHA) * old)

    def items_for(self, node: str, seconds: float) -> int:
        """How many of `node`'s items are predicted to fit in `seconds` (0 while its cost is
        not known)."""
        per_item = self.item_seconds.get(node)
        return int(seconds / per_item) if per_item else 0
