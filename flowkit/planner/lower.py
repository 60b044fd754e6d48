"""Lowering a flow into task rules: what each op is called on, how often, and where.

[Note: lowering by granularity] The port types decide how a node becomes tasks, and so where
stages fuse; the user never writes the fusion:
  source      no wired inputs: one task per step (a Stream result is a list of items)
  per item    Stream (or bare) inputs: one task per item, started as soon as that item exists,
              so scoring a sample overlaps generating the next
  per group   a Grouped input: one task per complete group of `size` items with one key
  once        Batch inputs only: one task when every producer has closed: a barrier
  pipeline    lowering = "pipeline": microbatches under a pipeline schedule, F/B/W per stage
  step        lowering = "step": one task per pipeline stage, after its W ops
A ModelOp declares the last two (`lowering`) and whether one call yields many items
(`many_per_call`), so the planner names no op of a flow library; what the runner needs to know
of it besides (`resumable`, `loss_spec`, ...) the NodePlan carries, so neither does the runner.
Pure: no torch, no zmq. The runtime (flowkit/runner/flowrun.py) carries the rules out.
"""

from __future__ import annotations

import enum
import inspect
from typing import Any

import attrs
import networkx as nx

from flowkit.dsl import (
    Flow,
    Granularity,
    LossSpec,
    Metrics,
    Model,
    Node,
    Resumable,
    Wire,
    Workload,
)
from flowkit.dsl.graph import GroupBy
from flowkit.dsl.operators import FunctionOp, ModelOp, yields_many

__all__ = ["Call", "InputRule", "NodePlan", "lower_flow"]


class Call(enum.Enum):
    SOURCE = "source"
    PER_ITEM = "per item"
    PER_GROUP = "per group"
    ONCE = "once"
    PIPELINE = "pipeline"
    STEP = "step"


@attrs.frozen
class InputRule:
    """Where one input port reads from, and how much of it each call takes."""

    port: str
    src: str  # producing node
    src_port: str
    granularity: Granularity  # as the consumer sees it, after any collect or group_by
    group_key: str | None = None
    group_size: int | None = None
    group_take: int | None = None  # the groups whose calls yield items that the step takes
    # rounds of prompts that may run to fill them (flowkit/runner/sampling_rounds.py)
    group_rounds: int | None = None
    # a group's consumer yields nothing for: that many more samples of its prompt, at most
    # the budget a step (flowkit/runner/second_round.py)
    group_second_round: int | None = None
    group_second_budget: int | None = None
    feedback: bool = False  # produced by the previous step
    chained: bool = False  # a feedback read from the step just before, even asynchronously


@attrs.frozen
class NodePlan:
    name: str
    call: Call
    op: str  # the executor op: "python" for function ops, else the model op's name
    inputs: tuple[InputRule, ...]
    outputs: tuple[str, ...]
    many: tuple[bool, ...]  # per output: each call yields many items (Stream/Batch) or one
    config: dict[str, Any]
    tags: tuple[str, ...] = ()
    model: Model | None = None
    target: str | None = None  # a function op's import path
    takes_step: bool = False  # the function has a `step` parameter: it is told the step number
    # a function op's keyword parameters (None: a model op's, or any: it takes **kwargs)
    keywords: frozenset[str] | None = None
    reports: bool = False  # its outputs are Metrics, which the runner adds to the step's own
    workload: Workload | None = None  # calls balanced by predicted work (a ModelOp's)
    trace_key: str | None = None  # its items' field a trace records (ModelOp.traced)
    # what the runner needs to know of a model op, as its class declares it
    fan_out: tuple[str, str] | None = None  # (config key of the items a call yields, field)
    resumable: Resumable | None = None  # its calls can be cut short and continued
    loss_spec: LossSpec | None = None  # what it trains with
    scores: bool = False  # may run in training executors' bubbles (ModelOp.scores)
    item_tokens: str | None = None  # its lead input items' field of their tokens
    # a backprop's frozen reference, run in its last stage's forward (config "reference")
    reference: Model | None = None

    def items_per_call(self) -> int:
        """How many items each call yields, as its fan-out declares (else one)."""
        return int(self.config.get(self.fan_out[0]) or 1) if self.fan_out else 1


_DECLARED_CALLS = {"pipeline": Call.PIPELINE, "step": Call.STEP}  # by ModelOp.lowering


def lower_flow(flow: Flow) -> list[NodePlan]:
    """The nodes of a valid flow in an order that runs producers first, with their rules."""
    flow.validate()
    wires = flow.wires
    graph = nx.DiGraph()
    graph.add_nodes_from(flow.nodes)
    graph.add_edges_from((w.src, w.dst) for w in wires if not w.feedback)
    position = {name: i for i, name in enumerate(flow.nodes)}  # ties run in declared order
    order = list(nx.lexicographical_topological_sort(graph, key=position.__getitem__))
    return [_plan_node(flow, flow.nodes[name], [w for w in wires if w.dst == name])
            for name in order]


def _plan_node(flow: Flow, node: Node, wires: list[Wire]) -> NodePlan:
    operator = node.operator
    declared = list(operator.inputs)  # ops take their inputs in declaration order
    wires = sorted(wires, key=lambda w: declared.index(w.dst_port)
                   if w.dst_port in declared else len(declared))
    inputs = tuple(_input_rule(flow, wire) for wire in wires)
    outputs = tuple(operator.outputs)
    reports = any(t.item is Metrics for t in operator.outputs.values())
    common = dict(name=node.name, inputs=inputs, outputs=outputs, config=dict(node.config),
                  tags=tuple(operator.tags), reports=reports)
    if isinstance(operator, ModelOp):
        model = flow.models[operator.model]
        call = _DECLARED_CALLS[operator.lowering] if operator.lowering else _call_of(inputs)
        return NodePlan(call=call, op=operator.kind, many=(operator.many_per_call,) * len(outputs),
                        model=model, workload=operator.workload, trace_key=operator.traced,
                        fan_out=operator.fan_out, resumable=operator.resumable,
                        loss_spec=operator.loss_spec, scores=operator.scores,
                        item_tokens=operator.item_tokens,
                        reference=flow.models.get(node.config.get("reference") or ""),
                        **{**common, "tags": common["tags"] or tuple(model.tags)})
    target = operator.target if isinstance(operator, FunctionOp) else None
    fn = getattr(operator, "fn", None)
    takes_step = fn is not None and "step" in inspect.signature(fn).parameters
    return NodePlan(call=_call_of(inputs), op="python", many=yields_many(operator),
                    target=target, takes_step=takes_step, keywords=_keywords(fn), **common)


def _keywords(fn: Any) -> frozenset[str] | None:
    """The keyword parameters of a function op (None: none known, or **kwargs takes any)."""
    if fn is None:
        return None
    parameters = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(p.name for p in parameters
                     if p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                   inspect.Parameter.POSITIONAL_OR_KEYWORD))


def _input_rule(flow: Flow, wire: Wire) -> InputRule:
    produced = flow.nodes[wire.src].operator.outputs[wire.src_port]
    seen = wire.adapter.apply(produced) if wire.adapter else produced  # through collect, group_by
    group = wire.adapter if isinstance(wire.adapter, GroupBy) else None
    return InputRule(port=wire.dst_port, src=wire.src, src_port=wire.src_port,
                     granularity=seen.granularity, group_key=group and group.key,
                     group_size=group and group.size, group_take=group and group.take,
                     group_rounds=group and group.rounds,
                     group_second_round=group and group.second_round,
                     group_second_budget=group and group.second_round_budget,
                     feedback=wire.feedback, chained=wire.chained)


def _call_of(inputs: tuple[InputRule, ...]) -> Call:
    live = [rule for rule in inputs if not rule.feedback]
    if not live:
        return Call.SOURCE
    if any(rule.granularity is Granularity.GROUPED for rule in live):
        return Call.PER_GROUP
    if any(rule.granularity is Granularity.STREAM for rule in live):
        return Call.PER_ITEM
    return Call.ONCE
