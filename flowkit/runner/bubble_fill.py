"""Bubble filling: a step's scoring runs on the training executors inside their pipeline's
bubbles, sized to fit.

[Note: bubble filling] `flowkit run --fill-bubbles` (RunConfig.fill_bubbles). A pipeline
schedule leaves each training executor idle at moments the planner knows ([Note: bubbles] in
flowkit/planner/bubbles.py). Scoring of the step's samples (an op whose class declares `scores`)
that waits for its own executors ([Note: batched per-item calls] in stepbatching.py) is lent
those slots as they open: bubbles come from the simulation of the planned schedule; a warm-up
bubble is lent while the pipeline waits for its first microbatch; an opening bubble gets the
held scoring items, oldest step first, as many as its time left holds at the node's learned
cost; while bubbles are lent a scoring node's own tasks hold about _FILL_TASK_S of work
(steplending.py). Why: the pipeline's actions never wait for a filler that keeps to its
predicted time, so the critical path is unchanged and scoring gains the trainers' idle time.
Only a frozen model's scoring is lent (a trained copy would miss its weight syncs); nothing is
lent with data-parallel replicas, fused models or two trained models on one executor. Measured
by `flowkit bench fill` (docs/performance.md, "Bubble filling"). In full: docs/schedules.md,
"Bubbles lent in a run".
"""

from __future__ import annotations

import functools
import queue
import time
from collections.abc import Callable, Sequence
from typing import Any

from flowkit.planner import Action, ActionKey, Costs, Schedule, simulate
from flowkit.planner.bubbles import bubbles
from flowkit.planner.lower import Call, NodePlan
from flowkit.runtime.registry import ExecutorInfo

__all__ = ["BubbleFill", "bubble_scorers"]

_ALPHA = 0.5  # weight of a batch's newest cost per item in the moving average


def bubble_scorers(plan: list[NodePlan]) -> frozenset[str]:
    """The nodes whose calls may run in a trainer's bubble: scoring (ModelOp.scores) with a
    model the flow does not train, whose copy on a trainer misses no weight sync."""
    trained = {node.model.name for node in plan
               if node.call is Call.PIPELINE and node.model is not None}
    return frozenset(node.name for node in plan if node.scores and node.model is not None
                     and node.model.name not in trained)


class BubbleFill:
    """A run's lending of its training executors' bubbles [Note: bubble filling]. `fill(executor,
    seconds)` is the runner's: it gives the open steps' held scoring items to `executor` for
    `seconds`, returning the futures that end each task it sent (none: nothing fitted)."""

    def __init__(self, events: queue.SimpleQueue, fill: Callable[[int, float], list],
                 nodes: frozenset[str] = frozenset()) -> None:
        self.events, self._fill = events, fill
        self.nodes = nodes  # those whose calls it lends bubbles to (`bubble_scorers`)
        self.item_seconds: dict[str, float] = {}  # node -> seconds each item of a batch adds
        self.one_item: dict[str, float] = {}  # node -> seconds of a task of one item
        self.lending = False  # a pipeline's bubbles are lent (else scoring keeps its sizes)
        self.ready: Callable[[Action], bool] = lambda action: False
        # executor -> (length, whether its pipeline started) of a warm-up bubble being lent,
        # and those whose fillers are running
        self.warm_ups: dict[int, tuple[float, Callable[[], bool]]] = {}
        self.lent: set[int] = set()

    def plan(self, schedule: Schedule, costs: Costs, executors: Sequence[ExecutorInfo],
             started: Callable[[], bool],
             ready: Callable[[Action], bool]) -> dict[ActionKey, tuple[int, float, Action]]:
        """The bubbles of `schedule` on `executors` by the action that opens each: (executor id,
        planned length, the action that ends it); the warm-up ones are lent until `started()`
        says the pipeline's first action went out. `ready(action)`: whether an action's inputs
        are made (a bubble before it is gone)."""
        self.lending, self.ready = True, ready
        opened_by = {}
        for slot in bubbles(simulate(schedule, costs)):
            executor = executors[slot.device].id
            if slot.before is None or slot.before.action.kind.is_copy:
                continue  # the cool-down: nothing of the step waits then; a copy: no task
            if slot.after is None:
                self._warm_up(executor, slot.length, started)
            elif not slot.after.action.kind.is_copy:
                opened_by[slot.after.action.key] = (executor, slot.length, slot.before.action)
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

    def watch(self, opened_by: dict[ActionKey, tuple[int, float, Action]], action: Action,
              future: Any) -> None:
        """Lend the bubble `action` opens, if any, when its task ends."""
        slot = opened_by.get(action.key)
        if slot is not None:
            future.add_done_callback(functools.partial(self._ended, *slot))

    def _ended(self, executor: int, length: float, before: Action, future: Any) -> None:
        if future.exception() is None and future.timing is not None:  # IO thread: queue it
            self.events.put(functools.partial(self._lend, executor, length, future.timing[1],
                                              before))

    def _lend(self, executor: int, length: float, since: float, before: Action) -> None:
        left = length - max(0.0, time.time() - since)
        if left > 0 and not self.ready(before):
            self._fill(executor, left)

    def learn(self, node: str, seconds: float, items: int) -> None:
        """A task of `node` took `seconds` for `items` items: a one-item task teaches what one
        item costs, a batch what each item adds (a task's fixed cost spread over its items)."""
        if items < 1 or seconds < 0:
            return
        known = self.one_item if items == 1 else self.item_seconds
        cost, old = seconds / items, known.get(node)
        known[node] = cost if old is None else _ALPHA * cost + (1 - _ALPHA) * old

    def items_for(self, node: str, seconds: float) -> int:
        """How many of `node`'s items are predicted to fit in `seconds`: one item's cost, then
        each further item's (0 while no task of it has ended)."""
        per_item = self.item_seconds.get(node)
        one = self.one_item.get(node, per_item)
        if not one or seconds < one:
            return 0
        return 1 + int((seconds - one) / (per_item or one))

    def predicted(self, node: str, items: int) -> float:
        """Seconds `items` of `node`'s items are predicted to take in one task."""
        per_item = self.item_seconds.get(node) or self.one_item.get(node, 0.0)
        return self.one_item.get(node, per_item) + (items - 1) * per_item
