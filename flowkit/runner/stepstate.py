"""What a running flow step knows: the items each output port produced, by lineage, and each
node's progress. A step (steprun.py) owns it; a model's training (model_training.py) reads the items
its backprop is fed from through an `Inputs` view.

Items carry a lineage (the path of call indices from the source that made them), so the inputs
of a per-item op pair up by sample whatever order they finish in.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import attrs

from flowkit.dsl import Granularity
from flowkit.planner.lower import InputRule, NodePlan
from flowkit.runner.balance import LengthEstimates
from flowkit.wire.refs import Gather

__all__ = ["BalancedCalls", "FlowRunError", "Inputs", "ItemStream", "NodeState", "RunnerState",
           "Streams", "Wiring", "arrived_since", "check_all_paired", "lineage_order",
           "sorted_lineages"]


class FlowRunError(RuntimeError):
    """A step could not finish: an op failed (the message carries the remote traceback)."""


@attrs.define
class ItemStream:
    """The items one output port produced this step, by lineage."""

    items: dict[tuple, Any] = attrs.field(factory=dict)
    keys: dict[tuple, Any] = attrs.field(factory=dict)
    arrivals: list[tuple] = attrs.field(factory=list)
    closed: bool = False
    _ordered: list | None = None  # ordered()'s last answer, until an item is added

    def add(self, lineage: tuple, ref: Any, key: Any = None) -> None:
        self.items[lineage] = ref
        self.keys[lineage] = key
        self.arrivals.append(lineage)
        self._ordered = None

    def ordered(self) -> list:
        """The items in their lineages' order (a closed stream's, asked at every look at its
        consumers, is sorted once; the list is shared: read it, do not change it)."""
        if self._ordered is None:
            self._ordered = [self.items[lin] for lin in sorted_lineages(self.items)]
        return self._ordered


class Streams(defaultdict):
    """A step's item streams by (node, port)."""

    def __init__(self) -> None:
        super().__init__(ItemStream)

    def of(self, rule: InputRule) -> ItemStream:
        """The stream an input port reads."""
        return self[(rule.src, rule.src_port)]

    def complete(self, live: list[InputRule]) -> list[tuple]:
        """Lineages every input port has, in the order the first port's items arrived."""
        others = [self.of(r).items for r in live[1:]]
        return [lin for lin in self.of(live[0]).arrivals
                if all(lin in items for items in others)]

    def gathered(self, rule: InputRule, lineages: list[tuple]) -> Gather:
        items = self.of(rule).items
        return Gather([items[lin] for lin in lineages])


@attrs.frozen
class Inputs:
    """A node's live inputs as its step's streams hold them: what a model's training reads of
    a backprop's items (the step owns the streams and alone writes them)."""

    streams: Streams
    rules: list[InputRule]

    def complete(self) -> list[tuple]:
        """Lineages every input has, in the order the first input's items arrived."""
        return self.streams.complete(self.rules)

    def gathered(self, lineages: list[tuple]) -> tuple[Gather, ...]:
        """Each input's items of `lineages`, in that order."""
        return tuple(self.streams.gathered(rule, lineages) for rule in self.rules)

    def tokens(self, lineages: list[tuple]) -> dict[tuple, int]:
        """Each lineage's tokens, as the first input's items reported them [Note: token-budget
        microbatches in token_microbatches.py]."""
        stream, rule = self.streams.of(self.rules[0]), self.rules[0]
        out = {lin: stream.keys.get(lin) for lin in lineages}
        missing = [lin for lin, n in out.items() if not isinstance(n, int)]
        if missing:
            raise FlowRunError(f"microbatch_tokens forms microbatches by the tokens of each "
                               f"item of {rule.src!r}, but its item {missing[0]} said none "
                               "(records that report their tokens: Rollout, Experience)")
        return out

    def first(self, lineages: list[tuple]) -> Gather:
        """The first input's items of `lineages`."""
        return self.streams.gathered(self.rules[0], lineages)

    @property
    def lead_arrivals(self) -> list[tuple]:
        """The first input's lineages, in the order they arrived."""
        return self.streams.of(self.rules[0]).arrivals

    def others(self) -> list[dict]:
        """The items of each input but the first, by lineage: look them up once a pass."""
        return [self.streams.of(rule).items for rule in self.rules[1:]]


@attrs.define
class NodeState:
    plan: NodePlan
    pending: int = 0  # tasks submitted and not yet done
    started: bool = False
    submitted: set = attrs.field(factory=set)  # lineages already called (per item / group)
    # per item: how far each input's arrivals were read, and the lead's items waiting for a
    # partner (lineage -> arrival number, their call order)
    cursors: dict = attrs.field(factory=dict)
    unpaired: dict = attrs.field(factory=dict)
    arrived: int = 0
    groups: dict = attrs.field(factory=lambda: defaultdict(list))
    seen: int = 0  # arrivals of the grouped input already sorted into groups
    closed: bool = False
    first_start: float | None = None
    last_end: float | None = None
    first_item: float | None = None  # when its first streamed item was ready (wall clock)
    backlog: list = attrs.field(factory=list)  # balanced calls to send: (lineage, key, refs)
    # per item: ready calls (lineage, refs) waiting for one of the node's tasks to end
    # [Note: batched per-item calls in stepbatching.py]
    held: list = attrs.field(factory=list)
    varying: list = attrs.field(factory=list)  # the ports whose refs differ from call to call
    filled: int = 0  # items run in training executors' bubbles [Note: bubble filling]
    lent: int = 0  # of its pending tasks, those in a trainer's bubble
    pipeline: Any = None  # a backprop's Feeding (model_training.py)
    streamed: dict = attrs.field(factory=lambda: defaultdict(int))  # lineage -> items so far


def arrived_since(streams: Streams, state: NodeState, streaming: list[InputRule]) -> list[tuple]:
    """The lineages that may have become callable since the last call, in the order the
    lead input's items arrived: its new items, and the waiting ones whose partner came.
    Each input's arrivals are read from a cursor, so a step's pairing is linear in its
    items, never a rescan of every arrival on every progress call."""
    touched = set()
    for index, rule in enumerate(streaming):
        stream = streams.of(rule)
        where = (rule.src, rule.src_port)
        new = stream.arrivals[state.cursors.get(where, 0):]
        state.cursors[where] = len(stream.arrivals)
        if index == 0:  # the lead: its items are the calls, in its order
            for lineage in new:
                if lineage not in state.submitted and lineage not in state.unpaired:
                    state.unpaired[lineage] = state.arrived
                    state.arrived += 1
                    touched.add(lineage)
        else:
            touched.update(lin for lin in new if lin in state.unpaired)
    return sorted(touched, key=state.unpaired.__getitem__)


def check_all_paired(streams: Streams, state: NodeState, live: list[InputRule]) -> None:
    streaming = [r for r in live if r.granularity is Granularity.STREAM]
    lead = streams.of(streaming[0])
    unpaired = [lin for lin in lead.arrivals if lin not in state.submitted]
    if unpaired:
        ports = ", ".join(f"{r.port} (from {r.src})" for r in streaming)
        raise FlowRunError(
            f"op {state.plan.name!r} is called per item of {ports}, but {len(unpaired)} "
            f"items of {streaming[0].port!r} have no partner in the other inputs: per-item "
            "inputs must come from the same items (e.g. both scored from one generate); "
            "collect() one of them if it is a different stream")


def lineage_order(lineage: tuple) -> tuple:
    """Sort lineages whose parts mix ints and strings (group keys) without comparing the two."""
    return tuple((isinstance(part, str), part) for part in lineage)


def sorted_lineages(lineages: Iterable[tuple]) -> list[tuple]:
    """`sorted(lineages, key=lineage_order)`, by the tuples themselves where that works: the
    same order, since a sort compares every pair of neighbours it leaves, and two that differ
    first at an int and a string would have raised. The key builds a tuple a lineage, which
    was a tenth of the controller's time at 16k samples a step."""
    try:
        return sorted(lineages)
    except TypeError:
        return sorted(lineages, key=lineage_order)


@attrs.frozen
class Wiring:
    """What every step of a run reads of its flow, fixed when the run starts."""

    plan: list[NodePlan]
    consumers: dict[str, list[str]]  # node -> the nodes that read it within a step
    report_keys: dict[str, str]  # node -> the field its items report as keys
    # the producers of grouped items: a carried call's keys are made its own there
    group_keyed: frozenset[str]
    # a model op's config, but the step: built once, not per item on the dispatch path
    op_configs: dict[str, dict]
    # False: every op waits for its producers to finish (stage by stage, a barrier between
    # stages), the baseline that sample-level fusion is measured against
    fuse: bool
    step_timeout: float


@attrs.frozen
class BalancedCalls:
    """A node whose calls are balanced by predicted work [Note: length-aware dispatch in
    balance.py]."""

    lead: InputRule  # the input whose items are the calls (the prompts)
    keyed: bool  # its items' keys are the workload's key (else no history: all alike)
    sized: bool  # the node's output keys are its items' sizes (else nothing is learned)
    # the calls' items all come from one source call: wait for its end (its items arrive
    # together anyway) so the step's calls can be sent longest first
    hold: bool
    estimates: LengthEstimates  # across steps


@attrs.frozen
class RunnerState:
    """A runner at a step boundary as a checkpoint reads it (checkpoints/): refs, which the
    checkpoint fetches. An asynchronous runner's open steps are in it once they have generated
    [Note: checkpoints that do not drain in flowkit/runner/checkpoints/writer.py]."""

    staleness: int | None
    placement: dict[str, list[str]]  # model -> the executors holding its stages, by name
    feedback: dict[tuple[str, str], Any]  # (node, port) -> what the next step reads of it
    training: dict[str, dict]  # model -> what its ModelTraining carries across steps
    profiles: dict  # (model, stages) -> profiled stage costs
    # step -> generating node -> its output items by lineage
    open_calls: dict[int, dict[str, dict[tuple, Any]]] = attrs.field(factory=dict)
    open_metrics: dict[int, dict[str, dict]] = attrs.field(factory=dict)  # step -> node ->
    carried: dict[int, dict[str, list]] = attrs.field(factory=dict)  # past the open steps
