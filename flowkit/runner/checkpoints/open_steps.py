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


# [Note: checkpoints of asynchronous runs] At the boundary after step k-1 trained (k steps done),
# steps k .. k+η-1 are open [Note: asynchronous steps in flowrun.py]: their generation may be done,
# running, or (partial rollouts, [Note: partial rollouts in partial.py]) carried from one step to
# the next. A checkpoint there
#   1. saves the executors' states at the boundary, where nothing trains (a step's training starts
#      only in the next `run_step`), so their weights and optimizer states are step k-1's, and lets
#      every open step's generating nodes (gated nodes whose op declares its calls resumable,
#      ModelOp.resumable: Generate's) end while the run goes on: the engines decode the open steps'
#      samples as they would have without the checkpoint, and the next step trains meanwhile
#      ([Note: checkpoints that do not drain] in writer.py);
#   2. fetches, for each open step and generating node, every call's output: the rollouts (tokens,
#      log-probs, the weights version of every token) in the order the call emitted them, and the
#      partial-rollout metrics the step will report; and the calls carried past the last open step
#      (interrupted samples with their per-token versions) — `OpenWork`, in the controller's
#      `RunState`;
#   3. writes the executors' states and the run state as a synchronous checkpoint does. A resumed
#      run opens steps k .. k+η-1 as the uninterrupted one would, but each of their generating nodes
#      makes exactly the saved calls (its call policy is a `Replay`), each given its saved rollouts,
#      which the engines pass through unchanged (a finished Rollout given to `generate` is its
#      output); the step's own prompts are not generated again. Everything downstream (rewards,
#      reference scores, advantages, training) runs as before. The carried calls go back into the
#      runner and continue from their prefixes in step k+η, as they would have. So:
#   - no sample is lost and none trained twice: every sample generated before the checkpoint is
#     trained in the step that took it, or carried, exactly as in the run that wrote it;
#   - the step counter goes on from k, and the source of step s draws step s's prompts;
#   - the staleness bound is the uninterrupted run's: the saved rollouts were admitted under it, the
#     restored feedback is version k (as at the boundary), and the runner opens steps s+1 .. s+η
#     while step s runs, no further;
#   - steps k .. k+η-1 train the same samples with the same per-token versions as the run that wrote
#     the checkpoint; later steps generate under whatever weights are newest, which on the simulator
#     (a request's tokens take the version of the weights it was sent with) is the uninterrupted
#     run's, so its curve is equal, and on torch (weights reach a running engine between its
#     iterations) depends on timing even between two uninterrupted runs. Other gated nodes (value
#     inference with a critic fed back) are not saved: a resumed run computes them again with the
#     newest weights, within the bound. Request names carry the runner's attempt, so an abort
#     remembered by a surviving executor from before a restart never cuts a replayed request ([Note:
#     executor restarts] in flowkit/runner/checkpoints/restarts.py).


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
            Carried(c.origin, c.lineage, ctl.put(list(c.items))))
    runner.resume_open_steps(calls, work.partial, carried)
