"""The validation rules of a flow; each returns problems rather than raising, so all are
reported."""

from __future__ import annotations

import difflib
import itertools
import re
from collections import defaultdict

import attrs

from flowkit.dsl.errors import Problem, suggest
from flowkit.dsl.graph import Collect, Feedback, FlowGraph, GroupBy, Wire
from flowkit.dsl.operators import FunctionOp, ModelOp, yields_many
from flowkit.dsl.types import Granularity, assignable

__all__ = ["find_problems"]

_MAX_CYCLES_REPORTED = 5


def find_problems(flow: FlowGraph) -> list[Problem]:
    operators = {id(node.operator): node.operator for node in flow.nodes.values()}  # each once
    problems = [problem for operator in operators.values() for problem in operator.problems]
    problems += flow.build_problems
    problems += _duplicate_names(flow)
    if not flow.nodes:
        problems.append(Problem(rule="empty-flow", message=f"flow {flow.name!r} has no operators",
                                fix="call ops inside `with Flow(...)`, or flow.add(...) them"))
    problems += _unknown_models(flow)
    wires = flow.wires
    # A feedback's consumers are checked against its declared type, and the output bound to it
    # against that type too (_feedback_problems): each mistake is reported once, where it is.
    for wire in flow.direct_wires:
        problems += _wire_problems(flow, wire)
        problems += _group_size_problems(flow, wire)
        problems += _group_take_problems(flow, wire)
    problems += _unbound_inputs(flow, wires)
    problems += _feedback_problems(flow)
    problems += _cycles(flow, wires)
    problems += _node_problems(flow)
    problems += _staleness_problems(flow)
    return _with_labels(flow, problems)


def _staleness_problems(flow: FlowGraph) -> list[Problem]:
    bound = flow.max_staleness
    if bound is None or (isinstance(bound, int) and not isinstance(bound, bool) and bound >= 0):
        return []
    return [Problem(rule="bad-config", message=f"flow {flow.name!r} has max_staleness={bound!r}",
                    fix="give a whole number >= 0 (0: on-policy, as the synchronous run), or "
                        "None to run synchronously")]


def _node_problems(flow: FlowGraph) -> list[Problem]:
    """What each op says of its own call (ModelOp.node_problems, a FunctionOp's `check`): run
    at validation, not at the call, so config changed after the build (flowkit run's options)
    is checked too."""
    return [problem for node in flow.nodes.values()
            if isinstance(node.operator, (ModelOp, FunctionOp))
            for problem in node.operator.node_problems(flow, node)]


def _with_labels(flow: FlowGraph, problems: list[Problem]) -> list[Problem]:
    """Show the names users gave, not the private keys of duplicates [Note: duplicate op names]."""
    keys = {key: node.label for key, node in flow.nodes.items() if key != node.label}
    if not keys:
        return problems
    pattern = re.compile("|".join(re.escape(k) for k in sorted(keys, key=len, reverse=True))
                         + r"(?!\d)")

    def shown(text):
        return pattern.sub(lambda m: keys[m.group()], text) if isinstance(text, str) else text

    return [attrs.evolve(p, **{f.name: shown(getattr(p, f.name)) for f in attrs.fields(Problem)})
            for p in problems]


def _duplicate_names(flow: FlowGraph) -> list[Problem]:
    by_label: dict[str, list] = defaultdict(list)
    for node in flow.nodes.values():
        by_label[node.label].append(node)
    problems = []
    for label, nodes in by_label.items():
        if len(nodes) < 2:
            continue
        fresh = (f"{label}_{i}" for i in itertools.count(2))
        names = list(itertools.islice((n for n in fresh if n not in by_label), len(nodes) - 1))
        calls = "; ".join(_describe_call(flow, node) for node in nodes)
        renames = ", ".join(f"{node.operator.name}(..., name={name!r})"
                            for node, name in zip(nodes[1:], names))
        problems.append(Problem(
            rule="duplicate-name", op=label,
            message=f"{len(nodes)} ops are named {label!r}: {calls}",
            fix=f"give each call its own name: {renames}"))
    return problems


def _describe_call(flow: FlowGraph, node) -> str:
    inputs = ", ".join(f"{w.dst_port}={w.src}.{w.src_port}" for w in flow.wires
                       if w.dst == node.name)
    where = f" at {node.origin}" if node.origin else ""
    return f"{node.operator.name}({inputs}){where}"


def _unknown_models(flow: FlowGraph) -> list[Problem]:
    problems = []
    for node in flow.nodes.values():
        if node.model is not None and node.model not in flow.models:
            close = difflib.get_close_matches(node.model, list(flow.models), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(Problem(
                rule="unknown-model", op=node.name,
                message=f"refers to model {node.model!r}, which the flow does not declare",
                fix=hint + f"declare it: flow.add_model(Model(name={node.model!r}, build=...)), "
                "or pass the Model object itself"))
    return problems


def _wire_problems(flow: FlowGraph, wire: Wire) -> list[Problem]:
    src, dst = flow.nodes.get(wire.src), flow.nodes.get(wire.dst)
    for name, node in ((wire.src, src), (wire.dst, dst)):
        if node is None:
            return [Problem(rule="unknown-op", message=f"a wire names op {name!r}, which is not "
                            "in the flow", op=name, fix=suggest(name, flow.nodes, "known ops"))]
    produced = src.operator.outputs.get(wire.src_port)
    if produced is None:
        return [Problem(rule="unknown-port", op=wire.src, port=wire.src_port,
                        message="has no such output port",
                        fix=suggest(wire.src_port, src.operator.outputs, "known outputs"))]
    port = dst.operator.inputs.get(wire.dst_port)
    if port is None:
        return [Problem(rule="unknown-port", op=wire.dst, port=wire.dst_port,
                        message="has no such input port",
                        fix=suggest(wire.dst_port, dst.operator.inputs, "known inputs"))]
    if wire.adapter is not None:
        produced = wire.adapter.apply(produced)
    through = f" through {wire.adapter}" if wire.adapter else ""
    origin = f"from {wire.src}.{wire.src_port}{through}"
    problems = _granularity_problems(wire, src.operator.outputs[wire.src_port], port.type, origin)
    problems += _item_problems(wire, produced, port.type, origin,
                               f"wire an output of type {port.type}")
    return problems + _group_key_problems(wire, produced)


def _item_problems(wire: Wire, produced, expected, origin: str, remedy: str) -> list[Problem]:
    reason = assignable(produced.item, expected.item)
    return [Problem(
        rule="type-mismatch", op=wire.dst, port=wire.dst_port,
        message=f"input gets the wrong item type ({origin}): {reason}",
        expected=str(expected), found=f"{produced} {origin}",
        fix=f"{remedy}, or change the annotation of {wire.dst}.{wire.dst_port}")] if reason else []


def _granularity_problems(wire: Wire, produced, expected, origin: str) -> list[Problem]:
    """Stream/Grouped reach a Batch port only through collect, anything reaches a Grouped port only
    through group_by; a Stream port takes anything (a Batch or groups are iterated item by item)."""
    collects, groups = isinstance(wire.adapter, Collect), isinstance(wire.adapter, GroupBy)
    if expected.granularity is Granularity.BATCH and produced.granularity is not Granularity.BATCH:
        if collects:
            return []
        return [Problem(
            rule="missing-collect", op=wire.dst, port=wire.dst_port,
            message=f"a {produced.granularity} feeds a Batch input ({origin}): waiting for the "
            "whole batch is a barrier, and barriers must be explicit",
            expected=str(expected), found=f"{produced} {origin}",
            fix=f"wrap the input in collect(...): {wire.dst}(collect({wire.src_port}))")]
    if expected.granularity is Granularity.GROUPED and not groups:
        if produced.granularity is Granularity.GROUPED and wire.adapter is None:
            return []
        return [Problem(
            rule="missing-group-by", op=wire.dst, port=wire.dst_port,
            message=f"a {produced.granularity} feeds a Grouped input ({origin}) without saying "
            "how items form groups",
            expected=str(expected), found=f"{produced} {origin}",
            fix="wrap the input in group_by(..., key='<field>', size=<n>)")]
    if collects and expected.granularity is not Granularity.BATCH:
        return [Problem(
            rule="useless-collect", op=wire.dst, port=wire.dst_port,
            message=f"collect feeds a {expected.granularity} input: it would add a barrier for "
            "nothing", expected=str(expected), found=f"{produced.granularity} through collect",
            fix="drop collect(...), or declare the input Batch[...] if the op needs all items")]
    return []


def _group_key_problems(wire: Wire, produced) -> list[Problem]:
    adapter, item = wire.adapter, produced.item
    if not isinstance(adapter, GroupBy) or not attrs.has(item):
        return []
    fields = [f.name for f in attrs.fields(item)]
    if adapter.key in fields:
        return []
    return [Problem(
        rule="unknown-group-key", op=wire.dst, port=wire.dst_port,
        message=f"group_by key {adapter.key!r} is not a field of {item.__qualname__}",
        fix=suggest(adapter.key, fields, "known fields"))]


def _group_size_problems(flow: FlowGraph, wire: Wire) -> list[Problem]:
    """A group_by whose groups are one call's fan-out (n samples of a prompt_id) must take
    whole groups: a size above n never fills, and one that does not divide n leaves a group
    cut short. Either way groups would only be flushed, incomplete, when the step ends."""
    adapter = wire.adapter
    if not isinstance(adapter, GroupBy) or adapter.size is None:
        return []
    source = _fan_out_source(flow, wire.src, wire.src_port, adapter.key, set())
    if source is None:
        return []
    node, count_key, count = source
    if not isinstance(count, int) or count < 1 or (adapter.size <= count
                                                   and count % adapter.size == 0):
        return []
    why = (f"no group can reach {adapter.size}" if adapter.size > count
           else f"the last group of each {adapter.key} stops at {count % adapter.size}")
    return [Problem(
        rule="group-size", op=wire.dst, port=wire.dst_port,
        message=f"group_by(key={adapter.key!r}, size={adapter.size}) takes the items of op "
        f"{node!r}, which makes {count_key}={count} per {adapter.key}: {why}, and incomplete "
        "groups would only be flushed when the step ends",
        expected=f"size={count} (or a divisor of it)", found=f"size={adapter.size}",
        fix=f"set group_by(..., size={count}), or {count_key}={adapter.size} on {node!r}")]


def _group_take_problems(flow: FlowGraph, wire: Wire) -> list[Problem]:
    """group_by(take=T) counts the groups its consumer yields items for: the consumer must be
    called per group and yield a Stream of one output [Note: group quota in
    flowkit/runner/quota.py]."""
    adapter = wire.adapter
    if not isinstance(adapter, GroupBy) or (adapter.take is None and
                                            adapter.second_round is None):
        return []
    operator = flow.nodes[wire.dst].operator
    if yields_many(operator) == (True,):
        return []
    what = f"takes the first {adapter.take} groups that op {wire.dst!r} yields items for" \
        if adapter.take is not None else f"samples again the groups op {wire.dst!r} yields " \
        "nothing for"
    setting = "take" if adapter.take is not None else "second_round"
    return [Problem(
        rule="group-take", op=wire.dst, port=wire.dst_port,
        message=f"group_by(..., {setting}=...) {what}, but it does not yield a Stream of one "
        "output",
        fix=f"give the op one output, -> Stream[...], yielding a group's items (none to drop "
        f"it), or drop {setting}")]


def _fan_out_source(flow: FlowGraph, name: str, port: str, key: str, seen: set
                    ) -> tuple[str, str, object] | None:
    """(op, config key, its value) of the op upstream of `name`.`port` whose calls fan out
    items sharing `key`, followed back through one-item-per-call ops (a reward, a join);
    None where the chain is broken by a collect, a group or an op that yields many."""
    node = flow.nodes.get(name)
    if node is None or name in seen:
        return None
    seen.add(name)
    operator = node.operator
    fan_out = getattr(operator, "fan_out", None) if isinstance(operator, ModelOp) else None
    if fan_out is not None:
        return (name, fan_out[0], node.config.get(fan_out[0])) if fan_out[1] == key else None
    outputs = list(operator.outputs)
    if port not in outputs or yields_many(operator)[outputs.index(port)]:
        return None
    for wire in flow.direct_wires:
        if wire.dst != name:
            continue
        input_port = operator.inputs.get(wire.dst_port)
        if wire.adapter is not None or input_port is None or \
                input_port.type.granularity is not Granularity.STREAM:
            return None
    for wire in flow.direct_wires:
        if wire.dst == name:
            found = _fan_out_source(flow, wire.src, wire.src_port, key, seen)
            if found is not None:
                return found
    return None


def _unbound_inputs(flow: FlowGraph, wires: list[Wire]) -> list[Problem]:
    feeding: dict[tuple[str, str], list[Wire]] = defaultdict(list)
    for wire in wires:
        feeding[wire.dst, wire.dst_port].append(wire)
    for fb, dst, port in flow.feedback_inputs:
        if fb.source is None:  # reported as an unbound feedback; the input itself is wired
            feeding[dst, port].append(None)
    problems = []
    for node in flow.nodes.values():
        for port in node.operator.inputs.values():
            if (node.name, port.name) in flow.misfed:  # its bad value is already reported
                continue
            sources = feeding.get((node.name, port.name), [])
            # A wire from a missing op or port is reported as such, not as a second producer.
            producers = [w for w in sources if w is None or flow.output_type(w.src, w.src_port)]
            if not sources and port.required:
                problems.append(Problem(
                    rule="unbound-input", op=node.name, port=port.name,
                    message="input is not connected to anything", expected=str(port.type),
                    found="nothing", fix=f"pass it when calling: {node.operator.name}("
                    f"{port.name}=...), or flow.connect('<op>.<output>', "
                    f"'{node.name}.{port.name}')"))
            elif len(producers) > 1:
                names = ", ".join(f"{w.src}.{w.src_port}" for w in producers if w is not None)
                problems.append(Problem(
                    rule="input-wired-twice", op=node.name, port=port.name,
                    message=f"input has {len(producers)} producers: {names}",
                    fix="wire one producer per input; merge streams in an op of their own"))
    return problems


def _feedback_problems(flow: FlowGraph) -> list[Problem]:
    uses: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for fb, dst, port in flow.feedback_inputs:
        uses[fb.name].append((dst, port))
    problems = []
    for fb in flow.feedbacks.values():
        consumers = uses.get(fb.name, [])
        problems += _feedback_use_problems(flow, fb, consumers)
        if fb.source is None:
            problems.append(_unbound_feedback(fb, consumers))
            continue
        if flow.output_type(fb.source.node, fb.source.port) is not None:
            produced = fb.source.type
            reason = assignable(produced.item, fb.type.item)
            if reason:
                problems.append(Problem(
                    rule="type-mismatch", op=fb.source.node, port=fb.source.port,
                    message=f"is bound to feedback {fb.name!r} of another type: {reason}",
                    expected=str(fb.type), found=str(produced),
                    fix=f"bind feedback {fb.name!r} to an output of type {fb.type}, or declare "
                    f"it with this output's type: flow.feedback({fb.name!r}, {produced})"))
    return problems


def _unbound_feedback(fb: Feedback, consumers: list[tuple[str, str]]) -> Problem:
    if not consumers:
        return Problem(
            rule="unbound-feedback", port=fb.name,
            message=f"feedback {fb.name!r} is declared but neither consumed nor bound",
            fix=f"pass {fb.name} as the input that takes the previous step's value and "
            f"{fb.name}.bind(<output>) to the op that produces it, or drop the declaration")
    op, port = consumers[0]
    takers = ", ".join(f"{dst}.{p}" for dst, p in consumers)
    return Problem(
        rule="unbound-feedback", op=op, port=port,
        message=f"feedback {fb.name!r} is consumed (by {takers}) but never bound to an output",
        fix=f"bind it to the op that produces the next step's value: {fb.name}.bind(<output>)")


def _feedback_use_problems(flow: FlowGraph, fb: Feedback,
                           consumers: list[tuple[str, str]]) -> list[Problem]:
    """The ports a feedback is passed to must take its declared type."""
    problems = []
    origin = f"from feedback {fb.name!r}"
    for dst, port_name in consumers:
        node = flow.nodes.get(dst)
        port = node.operator.inputs.get(port_name) if node is not None else None
        if port is None:  # reported as an unknown op or port where it was wired
            continue
        wire = Wire(fb.name, fb.name, dst, port_name, feedback=True)
        declare = (f"declare the feedback with the input's type: "
                   f"flow.feedback({fb.name!r}, {port.type})")
        for problem in _granularity_problems(wire, fb.type, port.type, origin):
            problems.append(attrs.evolve(problem, fix=declare))
        problems += _item_problems(wire, fb.type, port.type, origin, declare)
    return problems


def _cycles(flow: FlowGraph, wires: list[Wire]) -> list[Problem]:
    """One problem per cycle, at the port where the wire back into the op declared first enters
    it: that wire is most likely the one meant for the next step, so the fix names it."""
    import networkx as nx  # here: executors load this module, and never check a flow

    within = [w for w in wires if not w.feedback]
    graph = nx.DiGraph()
    graph.add_edges_from((w.src, w.dst) for w in within)
    order = {name: i for i, name in enumerate(flow.nodes)}
    problems = []
    for i, cycle in enumerate(nx.simple_cycles(graph)):
        if i == _MAX_CYCLES_REPORTED:
            break
        first = min(range(len(cycle)), key=lambda k: (order.get(cycle[k], len(order)), cycle[k]))
        cycle = cycle[first:] + cycle[:first]
        hops = [[w for w in within if (w.src, w.dst) == (a, b)]
                for a, b in zip(cycle, [*cycle[1:], cycle[0]])]
        path = ", ".join(f"{w.src}.{w.src_port} -> {w.dst}.{w.dst_port}"
                         for hop in hops for w in hop)
        closing = hops[-1][0]
        also = "".join(f" (and {w.src}.{w.src_port} -> {w.dst}.{w.dst_port})" for w in hops[-1][1:])
        node = flow.nodes.get(closing.dst)
        port = node.operator.inputs.get(closing.dst_port) if node is not None else None
        ptype = str(port.type) if port is not None else "<type>"
        problems.append(Problem(
            rule="cycle", op=closing.dst, port=closing.dst_port,
            message=f"ops depend on each other within one step: "
            f"{' -> '.join([*cycle, cycle[0]])} (wires {path}); the wire "
            f"{closing.src}.{closing.src_port} -> {closing.dst}.{closing.dst_port}{also} "
            "closes the loop",
            fix=f"if {closing.dst}.{closing.dst_port} should get the value of the previous step "
            "(as with weights synced back to generation), declare that edge into the next step "
            f"with flow.feedback: fb = flow.feedback({closing.dst_port!r}, {ptype}), pass fb as "
            f"{closing.dst}'s {closing.dst_port!r} input, then fb.bind(<{closing.src}'s "
            f"{closing.src_port!r} output>); otherwise remove one of these wires"))
    return problems
