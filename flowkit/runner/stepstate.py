"""What a running flow step knows: the items each output port produced, by lineage, and each
node's progress. The runner (flowrun.py) keeps it; a model's training (flowtrain.py) reads the
items its backprop is fed from.

Items carry a lineage (the path of call indices from the source that made them), so the inputs
of a per-item op pair up by sample whatever order they finish in.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import attrs

from flowkit.planner.lower import InputRule, NodePlan
from flowkit.wire.refs import Gather

__all__ = ["FlowRunError", "ItemStream", "NodeState", "Streams", "lineage_order"]


class FlowRunError(RuntimeError):
    """A step could not finish: an op failed (the message carries the remote traceback)."""


@attrs.define
class ItemStream:
    """The items one output port produced this step, by lineage."""

    items: dict[tuple, Any] = attrs.field(factory=dict)
    keys: dict[tuple, Any] = attrs.field(factory=dict)
    arrivals: list[tuple] = attrs.field(factory=list)
    closed: bool = False

    def add(self, lineage: tuple, ref: Any, key: Any = None) -> None:
        self.items[lineage] = ref
        self.keys[lineage] = key
        self.arrivals.append(lineage)

    def ordered(self) -> list:
        return [self.items[lin] for lin in sorted(self.items, key=lineage_order)]


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


@attrs.define
class NodeState:
    plan: NodePlan
    pending: int = 0  # tasks submitted and not yet done
    started: bool = False
    submitted: set = attrs.field(factory=set)  # lineages already called (per item / group)
    groups: dict = attrs.field(factory=lambda: defaultdict(list))
    seen: int = 0  # arrivals of the grouped input already sorted into groups
    closed: bool = False
    first_start: float | None = None
    last_end: float | None = None
    pipeline: Any = None  # a backprop's Feeding (flowtrain.py)
    streamed: dict = attrs.field(factory=lambda: defaultdict(int))  # lineage -> items so far


def lineage_order(lineage: tuple) -> tuple:
    """Sort lineages whose parts mix ints and strings (group keys) without comparing the two."""
    return tuple((isinstance(part, str), part) for part in lineage)
