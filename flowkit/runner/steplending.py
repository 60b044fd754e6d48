"""A step's scoring lent to the bubbles of a trainer's pipeline: the part of a `StepRun`
(steprun.py) that gives its held scoring items to a bubble [Note: bubble filling in
flowkit/runner/bubble_fill.py].
"""

from __future__ import annotations

import functools
from typing import Any

from flowkit.planner.lower import NodePlan
from flowkit.runner.bubble_fill import BubbleFill
from flowkit.runner.stepbatching import BATCH_ITEMS
from flowkit.runner.stepstate import NodeState

__all__ = ["BubbleLending"]

_FILL_TASK_S = 0.1  # predicted seconds of a scoring task while bubbles are filled


class BubbleLending:
    """Step `run`'s (a StepRun's) scoring nodes as the run's bubble filling lends them."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def fill(self, executor: int, seconds: float, bubble_fill: BubbleFill,
             ends: list) -> float:
        """Give the held items of this step's scoring nodes to `executor` for a bubble of
        `seconds` [Note: bubble filling in bubble_fill.py], adding to `ends` the future that ends
        each task sent; the seconds they are predicted to take."""
        used = 0.0
        for name, state in self.run.states.items():
            if state.closed or not state.held or not self._fills_bubbles(state.plan):
                continue
            count = min(len(state.held), BATCH_ITEMS,
                        bubble_fill.items_for(name, seconds - used))
            if count < 1:
                continue
            chunk, state.held = state.held[:count], state.held[count:]
            end = self.run.batching.submit_chunk(state, chunk, state.varying, executor=executor)
            ends.append(end)
            state.filled += count
            state.lent += 1  # not its own executors' room [Note: bubble filling]
            end.add_done_callback(lambda _, state=state: self.run.submission.events.put(
                functools.partial(_returned, state)))
            used += bubble_fill.predicted(name, count)
        return used

    def _fills_bubbles(self, plan: NodePlan) -> bool:
        """Whether a node's calls may run in a trainer's bubble (bubble_fill.py
        `bubble_scorers`)."""
        fill = self.run.submission.bubble_fill
        return fill is not None and plan.name in fill.nodes

    def fill_cap(self, plan: NodePlan) -> int:
        """Items a task of a scoring node while the run fills bubbles: about _FILL_TASK_S of
        them at its learned cost, so that its own executors take no more than they start soon
        and the rest waits for whichever frees first, one of them or a bubble; 0: not such a
        node, or its cost is not known yet (its first tasks teach it)."""
        fill = self.run.submission.bubble_fill
        if not self._fills_bubbles(plan) or not fill.lending:
            return 0
        one = fill.one_item.get(plan.name) or fill.item_seconds.get(plan.name)
        return max(1, min(BATCH_ITEMS, fill.items_for(plan.name, _FILL_TASK_S))) if one else 0


def _returned(state: NodeState) -> None:
    """A task lent a trainer's bubble ended [Note: bubble filling in bubble_fill.py]."""
    state.lent -= 1
