"""A synchronous run's next step's sources, called while this step runs [Note: sources ahead].

[Note: sources ahead] Step k+1 of a synchronous run cannot generate before step k's optimizer
step, but a source (a function op with no inputs: prompts, a data file's rows) reads nothing of
step k: its call is a function of the step number. So once step k's own sources are done, the
runner calls step k+1's, and step k+1 takes their futures and streamed items when it starts
instead of calling then. The README's Qwen2 SFT (150 steps, the median of steps 70-150, three
alternating pairs of `flowkit run examples/qwen2_sft.py` before and after): 115 -> 109 ms a step;
its GRPO, within this machine's noise (0.229 -> 0.235 s, 4 pairs). A call no step takes (the run
ended, stopped or restarted) is dropped with its futures; one that failed fails its own step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs

from flowkit.planner.lower import Call, NodePlan
from flowkit.runtime.futures import ExecutorLost

__all__ = ["SourcesAhead", "is_source"]


def is_source(plan: NodePlan) -> bool:
    """A node whose call reads nothing but its step number: no inputs, fed back or not, and no
    model whose weights a step changes."""
    return plan.call is Call.SOURCE and not plan.inputs and plan.model is None


@attrs.define(eq=False)
class _Call:
    """One source call made ahead: its futures, and until a step takes it the items it streamed
    and whether it ended (each a reaction, in the order the controller saw them)."""

    futures: Any
    events: Any
    parts: list = attrs.field(factory=list)
    ended: bool = False
    route: Callable[[Any], None] | None = None  # the step's, once it took the call
    done: Callable[[], None] | None = None

    def part(self, part: Any) -> None:
        if self.route is not None:
            self.route(part)
        else:
            self.parts.append(part)

    def end(self) -> None:
        if self.done is not None:
            self.done()
        else:
            self.ended = True

    @property
    def first(self) -> Any:
        """The future that ends the call (its first, for several outputs)."""
        return self.futures[0] if isinstance(self.futures, tuple) else self.futures

    def lost(self) -> bool:
        """Ended with its executor lost: the step calls its source afresh instead."""
        return self.ended and isinstance(self.first.exception(), ExecutorLost)

    def adopt(self, route: Callable[[Any], None], done: Callable[[], None]) -> None:
        """The step's handlers from now on: the items so far to `route` at once, the end once
        they are in (next in the queue if it came already)."""
        for part in self.parts:
            route(part)
        self.parts, self.route, self.done = [], route, done
        if self.ended:
            self.events.put(done)


@attrs.define(eq=False)
class SourcesAhead:
    """The sources of a run's plan, called a step ahead through `send(plan, step, on_part)`;
    `events`: the run's reactions, which a call's items and end come through; `credit(parts)`:
    take items in, from any thread ([Note: stream credits] in flowkit/runtime/credits.py):
    nothing reads an item called ahead before its step, so it is credited as it comes, and the
    executor goes on streaming between steps, when the run reads no reaction."""

    sources: list[NodePlan]
    send: Callable[[NodePlan, int, Any], Any]
    events: Any
    credit: Callable[[list], None]
    calls: dict[tuple[int, str], _Call] = attrs.field(factory=dict)
    _due: int | None = None  # the step whose sources are called once its own step's are done

    def after(self, step: int, next_step: int | None) -> None:
        """Step `step` runs: once its sources are done, call those of `next_step` (None: no
        step follows). Calls for any other step are dropped."""
        for key in [key for key in self.calls if key[0] not in (step, next_step)]:
            del self.calls[key]
        self._due = next_step

    def look(self, closed: Callable[[str], bool]) -> None:
        """Call the due step's sources if the running step's are done (`closed(name)`)."""
        step = self._due
        if step is None or not all(closed(plan.name) for plan in self.sources):
            return
        self._due = None
        events, credit = self.events, self.credit
        for plan in self.sources:
            call = self.calls[(step, plan.name)] = _Call(None, events)

            def streamed(part: Any, call: _Call = call) -> None:  # on the IO thread
                credit([part])
                events.put(functools.partial(call.part, part))

            call.futures = self.send(plan, step, streamed)
            # as a step's own calls are watched: right after sending, so the end's reaction
            # follows its items'
            call.first.add_done_callback(lambda _, call=call: events.put(call.end))

    def take(self, step: int, name: str) -> _Call | None:
        """`name`'s call for `step` if it was made ahead (and its executor was not lost)."""
        call = self.calls.pop((step, name), None)
        return None if call is None or call.lost() else call
