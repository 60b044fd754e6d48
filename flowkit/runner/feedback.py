"""What one step reads of the steps before it: the items fed back (weights versions, a critic), and
the admission gate that holds a node back until they are recent enough [Note: asynchronous steps
in flowkit/runner/flowrun.py].
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from flowkit.planner.lower import Call, InputRule, NodePlan
from flowkit.runner.stepstate import Streams

__all__ = ["Feedback"]


class Feedback:
    """The feedback edges of a flow across its steps, with staleness bound `staleness` (None:
    synchronous). `open`: the runner's open steps (step -> StepRun), which a production lets go
    on."""

    def __init__(self, plan: list[NodePlan], staleness: int | None, open: dict) -> None:
        self.staleness, self.open = staleness, open
        self.fed_back: set[tuple[str, str]] = {(rule.src, rule.src_port) for node in plan
                                               for rule in node.inputs if rule.feedback}
        # the nodes admission control holds back [Note: asynchronous steps]
        self.gated = [node.name for node in plan if node.call not in (Call.PIPELINE, Call.STEP)
                      and any(rule.feedback for rule in node.inputs)]
        # (node, port) -> step -> that step's streams, for the steps after it
        self.produced_at: dict[tuple[str, str], dict[int, Streams]] = defaultdict(dict)

    def resume(self, step: int, streams: Streams) -> None:
        """A resumed run's step `step` reads `streams` as the step before's."""
        for key in self.fed_back:
            if key in streams:
                self.produced_at[key] = {step - 1: streams}

    def produced(self, step: int, streams: Streams, node: str, port: str) -> None:
        """Step `step` added an item to (node, port) of its `streams`: if later steps read it,
        they may go on."""
        key = (node, port)
        if key not in self.fed_back:
            return
        earlier = self.produced_at[key]
        earlier[step] = streams
        for old in [s for s in earlier if s < step - 1]:
            del earlier[old]  # a step reads the newest weights only
        for later in sorted(s for s in self.open if s > step):
            for name in self.gated:
                self.open[later].progress(name)

    def _newest(self, rule: InputRule, step: int) -> tuple[int, Streams | None]:
        """(version, streams) of the newest production of `rule`'s port before `step`."""
        produced = self.produced_at.get((rule.src, rule.src_port), {})
        earlier = [s for s in produced if s < step]
        if not earlier:
            return 0, None
        newest = max(earlier)
        return newest + 1, produced[newest]

    def admits(self, step: int, plan: NodePlan) -> bool:
        """The admission gate: whether step `step`'s node may run with the weights there are
        [Note: asynchronous steps]; a chained feedback's reader waits for the step just before
        (`flow.feedback(..., chained=True)`)."""
        if self.staleness is None or plan.name not in self.gated:
            return True
        return all(self._newest(rule, step)[0] >= (step if rule.chained
                                                   else step - self.staleness)
                   for rule in plan.inputs if rule.feedback)

    def refs(self, plan: NodePlan, step: int) -> dict[str, Any]:
        """Inputs fed by an earlier step: the newest item of the producing port, if any."""
        refs = {}
        for rule in plan.inputs:
            if rule.feedback:
                _, streams = self._newest(rule, step)
                stream = None if streams is None else streams.get((rule.src, rule.src_port))
                if stream is not None and stream.items:
                    refs[rule.port] = stream.ordered()[-1]
        return refs
