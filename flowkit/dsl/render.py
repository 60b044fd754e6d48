"""Views of a flow for people: a rich summary and Graphviz DOT text."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from flowkit.dsl.graph import Collect, FlowGraph, Node, Wire
from flowkit.dsl.types import Granularity

__all__ = ["describe", "summary", "to_dot"]

_GRANULARITY_STYLE = {Granularity.STREAM: "green", Granularity.BATCH: "bold red",
                      Granularity.GROUPED: "yellow"}


def describe(flow: FlowGraph, console: Console | None = None) -> None:
    (console or Console()).print(summary(flow))


def summary(flow: FlowGraph) -> Group:
    """A renderable: each op with its ports (type, granularity, source), then models, then the
    wires where a step waits (barriers), groups or hands a value to the next step."""
    wires = flow.wires
    parts: list[Any] = [Text(f"flow {flow.name!r}: {len(flow.nodes)} ops, {len(wires)} wires",
                             style="bold underline")]
    for node in flow.nodes.values():
        parts.append(_node_text(node, wires))
    if flow.models:
        models = Table(title="models", title_justify="left")
        for column in ("model", "build", "stages", "replicas", "tags", "used by"):
            models.add_column(column, overflow="fold")
        for model in flow.models.values():
            users = [n.name for n in flow.nodes.values() if n.model == model.name]
            models.add_row(model.name, model.build, str(model.stages), str(model.replicas),
                           ",".join(model.tags), ", ".join(users))
        parts.append(models)
    boundaries = [w for w in wires if w.adapter is not None or w.feedback]
    if boundaries:
        parts.append(Text("step boundaries:", style="bold"))
        parts += [Text(f"  {_wire_text(w)}") for w in boundaries]
    return Group(*parts)


def _node_text(node: Node, wires: list[Wire]) -> Text:
    text = Text("\n")
    text.append(node.name, style="bold")
    text.append(f"  {node.operator.kind}")
    if node.model:
        text.append(f" on {node.model}", style="cyan")
    changed = {k: v for k, v in node.config.items() if v != node.operator.config.get(k)}
    if changed:
        text.append("  " + ", ".join(f"{k}={v!r}" for k, v in changed.items()), style="dim")
    for port in node.operator.inputs.values():
        text.append("\n  in  ")
        text.append_text(_port_text(port.name, port.type))
        sources = [_source_text(w) for w in wires
                   if w.dst == node.name and w.dst_port == port.name]
        if sources:
            text.append(" <- " + ", ".join(sources), style="dim")
        elif not port.required:
            text.append(" (optional, not wired)", style="dim")
    for name, ptype in node.operator.outputs.items():
        text.append("\n  out ")
        text.append_text(_port_text(name, ptype))
    return text


def _port_text(name: str, ptype) -> Text:
    text = Text(f"{name}: ")
    text.append(str(ptype), style=_GRANULARITY_STYLE[ptype.granularity])
    return text


def _source_text(wire: Wire) -> str:
    text = f"{wire.src}.{wire.src_port}"
    if wire.adapter is not None:
        text = f"{wire.adapter}({text})"
    return text + (" [previous step]" if wire.feedback else "")


def _wire_text(wire: Wire) -> str:
    target = f"{wire.dst}.{wire.dst_port}"
    if wire.feedback:
        return f"{wire.src}.{wire.src_port} -> {target}: feeds the next step"
    kind = "barrier: waits for every item" if isinstance(wire.adapter, Collect) else (
        "groups items")
    return f"{_source_text(wire)} -> {target}: {kind}"


def to_dot(flow: FlowGraph) -> str:
    """DOT text: ops as boxes (model ops filled), edges labelled with port types; a barrier edge
    is bold red, a feedback edge dashed and does not constrain the layout."""
    lines = [f"digraph {_quote(flow.name)} {{", "  rankdir=LR;",
             '  node [shape=box, style="rounded", fontname="Helvetica"];',
             '  edge [fontname="Helvetica", fontsize=10];']
    for node in flow.nodes.values():
        label = f"{node.name}\\n{node.operator.kind}" + (f" @ {node.model}" if node.model else "")
        style = ', style="rounded,filled", fillcolor="#dbe9f6"' if node.model else ""
        lines.append(f"  {_quote(node.name)} [label={_quote(label)}{style}];")
    for wire in flow.wires:
        lines.append(f"  {_quote(wire.src)} -> {_quote(wire.dst)} [{_edge_attrs(flow, wire)}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _edge_attrs(flow: FlowGraph, wire: Wire) -> str:
    ptype = flow.output_type(wire.src, wire.src_port)
    if ptype is not None and wire.adapter is not None:
        ptype = wire.adapter.apply(ptype)
    label = f"{wire.src_port} -> {wire.dst_port}"
    if ptype is not None:
        label += f"\\n{ptype}"
    attrs = []
    if wire.adapter is not None:
        label += f"\\n{wire.adapter}"
        if isinstance(wire.adapter, Collect):
            attrs += ['color="#c0392b"', "penwidth=2"]
    if wire.feedback:
        label += "\\n(next step)"
        attrs += ["style=dashed", "constraint=false"]
    return ", ".join([f"label={_quote(label)}", *attrs])


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\\\\n", "\\n") + '"'
