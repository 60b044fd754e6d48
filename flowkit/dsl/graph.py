"""A flow's parts (nodes, wires, their adapters, feedbacks) and FlowGraph, what checks read."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from flowkit.dsl.errors import Problem
from flowkit.dsl.operators import FlowValue, Model, Operator
from flowkit.dsl.types import Granularity, PortType

if TYPE_CHECKING:  # networkx costs 0.16 s to import: executors, which load flowkit.dsl
    import networkx as nx  # for the records, never build the graph

__all__ = ["Collect", "Feedback", "FlowGraph", "GroupBy", "Node", "Ref", "Wire"]


@attrs.frozen
class Collect:
    """Gather a Stream into a Batch: the barrier a Batch port implies, made explicit."""

    def __str__(self) -> str:
        return "collect"

    def apply(self, ptype: PortType) -> PortType:
        return PortType(Granularity.BATCH, ptype.item)


@attrs.frozen
class GroupBy:
    """Form keyed groups of `size` items (None: as many as share the key by the end of the step);
    with `take`, the consumer's first `take` calls that yield anything are the step's, the
    later ones dropped (flowkit/runner/quota.py); with `rounds`, the step's prompts are called
    a round at a time until `take` groups yield (flowkit/runner/sampling_rounds.py); with
    `second_round`, a group the consumer yields nothing for gets that many more samples of its
    prompt, `second_round_budget` a step at most (flowkit/runner/second_round.py)."""

    key: str
    size: int | None = None
    take: int | None = None
    rounds: int | None = None
    second_round: int | None = None
    second_round_budget: int | None = None

    def __str__(self) -> str:
        extra = "".join(f", {name}={value}" for name, value in (
            ("size", self.size), ("take", self.take), ("rounds", self.rounds),
            ("second_round", self.second_round),
            ("second_round_budget", self.second_round_budget)) if value is not None)
        return f"group_by({self.key}{extra})"

    def apply(self, ptype: PortType) -> PortType:
        return PortType(Granularity.GROUPED, ptype.item)


@attrs.frozen(eq=False)
class Ref(FlowValue):
    """A handle on one output port of one node, possibly with an adapter (collect, group_by)."""

    flow: FlowGraph = attrs.field(repr=False)
    node: str
    port: str
    adapter: Collect | GroupBy | None = None

    @property
    def type(self) -> PortType:
        produced = self.flow.nodes[self.node].operator.outputs[self.port]
        return self.adapter.apply(produced) if self.adapter else produced

    def __str__(self) -> str:
        text = f"{self.node}.{self.port}"
        return f"{self.adapter}({text})" if self.adapter else text


@attrs.frozen
class Wire:
    src: str
    src_port: str
    dst: str
    dst_port: str
    adapter: Collect | GroupBy | None = None
    feedback: bool = False  # feeds the next step: not part of this step's dependency graph
    chained: bool = False  # a feedback each step reads from the step just before, even async


@attrs.frozen(eq=False)
class Node:
    """One call of an operator in a flow. `name` is its unique key in the flow; `label` is the
    name the user gave, which differs only for a duplicate [Note: duplicate op names]."""

    name: str
    operator: Operator
    config: dict[str, Any]
    label: str = attrs.field(default=attrs.Factory(lambda self: self.name, takes_self=True))
    origin: str | None = None  # "file.py:12": where the user added it, to tell duplicates apart

    @property
    def model(self) -> str | None:
        return self.operator.model


class Feedback(FlowValue):
    """A value consumed this step and produced by a later op for the next step (e.g. weights
    synced from the trainer back to generation). Its wire is not a cycle."""

    def __init__(self, flow: FlowGraph, name: str, ptype: PortType, *,
                 chained: bool = False) -> None:
        self.flow, self.name, self.type, self.chained = flow, name, ptype, chained
        self.source: Ref | None = None

    def bind(self, ref: Ref) -> None:
        if self.source is not None:
            self.flow._problem("feedback-bound-twice", f"feedback {self.name!r} is bound twice",
                               fix="bind each feedback to exactly one output")
        self.source = ref

    def __repr__(self) -> str:
        return f"<Feedback {self.name}: {self.type} from {self.source}>"


class FlowGraph:
    """The nodes, models, feedbacks and wires of one flow: built by `Flow`, read by the rest."""

    def __init__(self, name: str, *, description: str = "",
                 max_staleness: int | None = None) -> None:
        self.name = name
        self.description = description
        # run asynchronously, generation at most this many weights versions ahead of training
        # (`flowkit run --async --max-staleness`); None: synchronously
        self.max_staleness = max_staleness
        # a flow of its own that evaluates this one's models between steps (`flowkit run
        # --eval-every K`: dataflows/rl/evaluation.py makes the RL flows'); None: none
        self.evaluation: FlowGraph | None = None
        self.nodes: dict[str, Node] = {}
        self.models: dict[str, Model] = {}
        self.feedbacks: dict[str, Feedback] = {}
        self._wires: list[Wire] = []
        self._feedback_inputs: list[tuple[Feedback, str, str]] = []
        self._problems: list[Problem] = []
        self._misfed: set[tuple[str, str]] = set()

    @property
    def wires(self) -> list[Wire]:
        """All wires, including feedback wires from bound feedbacks to their consumers."""
        bound = [(fb, dst, port) for fb, dst, port in self._feedback_inputs
                 if fb.source is not None]
        return [*self._wires, *(Wire(fb.source.node, fb.source.port, dst, port,
                                     fb.source.adapter, feedback=True, chained=fb.chained)
                                for fb, dst, port in bound)]

    @property
    def direct_wires(self) -> tuple[Wire, ...]:
        """The wires made by op calls and `connect`: all but those from bound feedbacks."""
        return tuple(self._wires)

    @property
    def feedback_inputs(self) -> tuple[tuple[Feedback, str, str], ...]:
        """(feedback, op, port) for each input a feedback is passed to, bound or not."""
        return tuple(self._feedback_inputs)

    @property
    def build_problems(self) -> tuple[Problem, ...]:
        """What went wrong while building (a bad call, a bad wire), found before any check runs."""
        return tuple(self._problems)

    @property
    def misfed(self) -> frozenset[tuple[str, str]]:
        """Inputs (op, port) given what could not be wired: reported, so not also unbound."""
        return frozenset(self._misfed)

    def output_type(self, node: str, port: str) -> PortType | None:
        """What `node.port` produces; None when the flow has no such op or output."""
        src = self.nodes.get(node)
        return src.operator.outputs.get(port) if src is not None else None

    @property
    def graph(self) -> nx.DiGraph:
        """Nodes carry `node=Node`; an edge carries `wires`, the list of port-to-port wires."""
        import networkx as nx

        graph = nx.DiGraph(name=self.name)
        for name, node in self.nodes.items():
            graph.add_node(name, node=node)
        for wire in self.wires:
            if wire.src in graph and wire.dst in graph:
                graph.add_edge(wire.src, wire.dst)  # a second wire keeps the edge's data
                graph.edges[wire.src, wire.dst].setdefault("wires", []).append(wire)
        return graph

    def _problem(self, rule: str, message: str, **where: Any) -> None:
        self._problems.append(Problem(rule=rule, message=message, **where))
