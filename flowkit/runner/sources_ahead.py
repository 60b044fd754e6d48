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

__all__ = ["SourcesAhead", "is_source"]


def is_source(plan: NodePlan) -> bool:
    """A node whose call reads nothing but its step number: no inputs, fed back or not, and no
    model whose weights a step changes."""
    return plan.call is Call.SOURCE and not plan.inputs and plan.model is None


@attrs.define(eq=False)
class _Call:
    """One source call made ahead: its futures, and the items it streamed before a step took it
    (credited as they came, so the executor goes on streaming meanwhile)."""

    futures: Any = None
    parts: list = attrs.field(factory=list)
    route: Callable[..., None] | None = None  # the step's handler, once one took the call

    def part(self, credit: Callable[[Any], None], part: Any) -> None:
        """A streamed item, on the run's thread (a reaction)."""
        if self.route is not None:
            self.route(part)
        else:
            self.parts.append(part)
            credit(part)


@attrs.define(eq=False)
class SourcesAhead:
    """The sources of a run's plan, called a step ahead through `send(plan, step, on_part)`;
    `events`: the run's reactions, which a streamed item comes through; `credit(part)`: the
    item is taken in ([Note: stream credits] in flowkit/runtime/credits.py)."""

    sources: list[NodePlan]
    send: Callable[[NodePlan, int, Any], Any]
    events: Any
    credit: Callable[[Any], None]
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
        for plan in self.sources:
            call = self.calls[(step, plan.name)] = _Call()
            call.futures = self.send(plan, step, self._streamed(call))

    def _streamed(self, call: _Call) -> Callable[[Any], None]:
        events, credit = self.events, self.credit
        return lambda part: events.put(functools.partial(call.part, credit, part))

    def take(self, step: int, name: str, route: Callable[..., None]) -> Any:
        """The futures of `name`'s call for `step` if it was made ahead (None if not), its
        items streamed so far given to `route(part, credited=True)` and later ones to
        `route(part)`."""
        call = self.calls.pop((step, name), None)
        if call is None:
            return None
        for part in call.parts:
            route(part, credited=True)
        call.route, call.parts = route, []
        return call.futures
