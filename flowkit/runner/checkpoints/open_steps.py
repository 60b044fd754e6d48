"""What a checkpoint of an asynchronous run holds of the steps open at its boundary, and how a
resumed run goes on with them.

The design: [Note: checkpoints of asynchronous runs] below.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import attrs

from flowkit.runner.call_policy import CallSite
from flowkit.runner.partial import Carried, CarryOver
from flowkit.runner.stepstate import RunnerState, sorted_lineages
from flowkit.wire.refs import Item

__all__ = ["CarriedCall", "OpenCall", "OpenWork", "Replay", "open_work", "resume_open"]


# [Note: checkpoints of asynchronous runs] At the boundary after step k-1 trained, steps
# k .. k+η-1 are open [Note: asynchronous steps in flowrun.py] and may be generating, or carry
# calls from step to step [Note: partial rollouts in partial.py]. A checkpoint there saves the
# executors' states at the boundary (nothing trains: weights and optimizer states are step k-1's),
# lets the open steps' generating nodes (ModelOp.resumable) end while step k trains ([Note:
# checkpoints that do not drain] in writer.py), then fetches every call's rollouts (tokens,
# log-probs, per-token versions) in emitted order, the partial-rollout metrics and the calls
# carried past the last open step: `OpenWork`, in the controller's `RunState`. A resumed run
# opens the same steps, each generating node makes exactly the saved calls (a `Replay` call
# policy) and the engines pass the saved rollouts through; carried calls continue in step k+η.
# Why: no sample is lost or trained twice, the step counter and the staleness bound are the
# uninterrupted run's. Other gated nodes (value inference) are recomputed with the newest
# weights; request names carry the runner's attempt ([Note: executor restarts] in
# flowkit/runner/checkpoints/restarts.py). In full: docs/running-flows.md, "Checkpoints of
# asynchronous runs".


@attrs.frozen
class OpenCall:
    """One generating call of an open step, done: its output items in emission order."""

    lineage: tuple
    items: list


@attrs.frozen
class CarriedCall:
    """A call carried into a step not open yet [Note: partial rollouts in partial.py]."""

    step: int
    node: str
    origin: int
    lineage: tuple
    items: list


@attrs.define(kw_only=True)
class OpenWork:
    """The controller's part of an asynchronous checkpoint beyond a synchronous one's."""

    calls: dict[int, dict[str, list[OpenCall]]] = attrs.field(factory=dict)  # step -> node
    partial: dict[int, dict[str, dict]] = attrs.field(factory=dict)  # step -> node -> metrics
    carried: list[CarriedCall] = attrs.field(factory=list)

    def rollouts(self) -> int:
        """How many generated samples it holds."""
        return (sum(len(c.items) for by_node in self.calls.values()
                    for calls in by_node.values() for c in calls)
                + sum(len(c.items) for c in self.carried))


@attrs.define
class Replay:
    """A resumed open step's generating node (its call policy, call_policy.py): exactly the
    checkpointed calls, each given its saved rollouts (passed through), in place of the
    step's own prompts, reporting the partial-rollout metrics the checkpointed step had."""

    name: str
    step: int
    calls: dict[tuple, Any]  # lineage -> the saved rollouts of that call
    saved_metrics: dict[str, float]
    ledger: CarryOver
    outgoing: list[Carried] = attrs.field(factory=list)  # nothing is carried into it: passed on
    streams_parts = False

    def submit(self, site: CallSite, prompts_closed: bool) -> bool:
        for lineage, ref in self.calls.items():
            site.submit(lineage, ref)
        self.calls = {}
        return True

    def admit(self, prompts: int, lineage: tuple) -> bool:
        return False  # the step's own prompts were generated before the checkpoint

    def config(self, lineage: tuple) -> dict:
        return {}

    def done(self, lineage: tuple, future: Any, site: CallSite) -> bool:
        return True

    def may_close(self) -> bool:
        return True

    def closed(self) -> None:
        self.ledger.carry(self.name, self.step, self.outgoing)

    def receive(self, calls: list, *, closed: bool) -> None:
        self.outgoing.extend(calls)

    def metrics(self, timeout: float) -> dict[str, float]:
        return dict(self.saved_metrics)


class OpenSteps(Protocol):
    """What a checkpoint drains of a runner (flowrun.FlowRunner)."""

    def run_reactions(self, timeout: float) -> None:
        """Run the queued reactions (queue.Empty if none comes within `timeout`)."""

    def open_resumable(self) -> dict[int, dict[str, bool]]:
        """Each open step's generating nodes: whether each has ended."""


def open_work(ctl: Any, state: RunnerState, timeout: float) -> OpenWork:
    """Fetch what the open steps of a runner's `state` generated and what is carried past
    them, every value asked for at once."""
    refs = [ref for by_node in state.open_calls.values() for items in by_node.values()
            for ref in items.values()]
    refs += [c.ref for by_node in state.carried.values() for carried in by_node.values()
             for c in carried]
    fetched = _Fetched(ctl, refs, timeout)
    work = OpenWork()
    for step, by_node in sorted(state.open_calls.items()):
        for name, items in by_node.items():
            calls: dict[tuple, list] = {}
            for lineage in sorted_lineages(items):
                calls.setdefault(lineage[:-1], []).append(fetched(items[lineage]))
            work.calls.setdefault(step, {})[name] = [OpenCall(lin, values)
                                                     for lin, values in calls.items()]
    for step, by_node in state.open_metrics.items():
        work.partial[step] = dict(by_node)
    for step, by_node in sorted(state.carried.items()):
        for name, carried in by_node.items():
            work.carried += [CarriedCall(step, name, c.origin, c.lineage,
                                         list(fetched(c.ref))) for c in carried]
    return work


class _Fetched:
    """The values of `refs` (futures, or items of a future's list), each future fetched once,
    all of them together."""

    def __init__(self, ctl: Any, refs: list, timeout: float) -> None:
        futures = {}
        for ref in refs:
            future = ref.future if isinstance(ref, Item) else ref
            futures.setdefault(future.id, future)
        values = ctl.fetch_many(list(futures.values()), timeout=timeout)
        self.values = dict(zip(futures, values))

    def __call__(self, ref: Any) -> Any:
        if isinstance(ref, Item):
            return self.values[ref.future.id][ref.index]
        return self.values[ref.id]


class Resuming(Protocol):
    """What a resumed runner takes back of its open steps (flowrun.FlowRunner)."""

    def resume_open_steps(self, calls: Mapping[int, dict[str, dict[tuple, Any]]],
                          metrics: Mapping[int, dict[str, dict]],
                          carried: Mapping[int, dict[str, list[Carried]]]) -> None: ...


def resume_open(runner: Resuming, ctl: Any, work: OpenWork) -> None:
    """The open steps of a resumed run replay `work`'s calls; carried calls wait for their
    step."""
    calls = {step: {name: {c.lineage: ctl.put(list(c.items)) for c in node_calls}
                    for name, node_calls in by_node.items()}
             for step, by_node in work.calls.items()}
    carried: dict[int, dict[str, list[Carried]]] = {}
    for c in work.carried:
        carried.setdefault(c.step, {}).setdefault(c.node, []).append(
            Carried(c.origin, c.lineage, ctl.put(list(c.items)), count=len(c.items)))
    runner.resume_open_steps(calls, work.partial, carried)
