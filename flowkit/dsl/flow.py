"""`Flow`: operators and the wires between them, held in a networkx.DiGraph.

Two ways to build one, freely mixed:

    with Flow("grpo") as flow:                       # calls wire themselves
        rollouts = generate(prompts, n=8)
        adv = grpo_advantages(group_by(score(rollouts), key="prompt_id", size=8))

    flow = Flow("grpo")                               # or explicit nodes and wires
    flow.add(generate, n=8); flow.add(score)
    flow.connect("generate.rollouts", "score.rollout")

Building records problems instead of raising; leaving the `with` block (or `flow.validate()`)
raises one FlowError that lists every one of them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import attrs

from flowkit.dsl.checks import find_problems
from flowkit.dsl.errors import FlowError, Problem, suggest
from flowkit.dsl.graph import Collect, Feedback, FlowGraph, GroupBy, Node, Ref, Wire
from flowkit.dsl.operators import ACTIVE_FLOW, REQUIRED, Model, Operator
from flowkit.dsl.types import port_type

# The graph's parts too, so that code importing them from here keeps working.
__all__ = ["Collect", "Feedback", "Flow", "GroupBy", "Node", "Outputs", "Ref", "Wire",
           "collect", "group_by"]


class Outputs(dict):
    """The output refs of a multi-output op: by attribute, by key, or unpacked in order."""

    def __getattr__(self, port: str) -> Ref:
        try:
            return self[port]
        except KeyError:
            raise AttributeError(f"no output port {port!r}; outputs are {list(self)}") from None

    def __iter__(self):
        return iter(self.values())


def collect(ref: Ref) -> Ref:
    """Gather the items of a Stream (or the groups of a Grouped) into one Batch: a barrier."""
    return _adapt(ref, Collect())


def group_by(ref: Ref, *, key: str, size: int | None = None, take: int | None = None,
             rounds: int | None = None, second_round: int | None = None,
             second_round_budget: int | None = None) -> Ref:
    """Group a Stream's items by the record field `key`, `size` items per group. `take`: the
    consuming op (called per group, yielding a Stream) runs on every group, and the first
    `take` groups it yields items for are the step's; the items of later ones are dropped, as
    are groups it yields nothing for. Over-provision the groups and filter them in the op:
    DAPO's dynamic sampling. `rounds` (with `take`): the step's source makes that many rounds
    of prompts, and the first per-item op after it (generation) runs one round, then the next
    only while the groups still to come cannot make up `take` [Note: sampling rounds in
    flowkit/runner/sampling_rounds.py]. `second_round` (size None): the op runs on a group as
    soon as its prompt's samples are in, and a group it yields nothing for (rewards that all
    agree) gets `second_round` more samples of its prompt from generation, while the step's
    `second_round_budget` samples last (None: every such group); the op then runs on all of
    them [Note: second rounds in flowkit/runner/second_round.py]."""
    for name, value in (("take", take), ("rounds", rounds), ("second_round", second_round)):
        if value is not None and not _whole(value, low=1):
            raise ValueError(f"group_by({name}={value!r}): a whole number >= 1 (None: "
                             f"{_NONE_MEANS[name]})")
    if rounds is not None and take is None:
        raise ValueError(f"group_by(rounds={rounds}) calls the prompts in rounds until `take` "
                         "groups yield: give take too")
    _check_second_round(size, take, second_round, second_round_budget)
    return _adapt(ref, GroupBy(key, size, take, rounds, second_round, second_round_budget))


_NONE_MEANS = {"take": "every group", "rounds": "one round", "second_round": "no second round"}


def _whole(value: object, *, low: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= low


def _check_second_round(size: int | None, take: int | None, second_round: int | None,
                        budget: int | None) -> None:
    """A second round's settings [Note: second rounds in flowkit/runner/second_round.py]."""
    if budget is not None and (second_round is None or not _whole(budget, low=0)):
        raise ValueError(f"group_by(second_round_budget={budget!r}): the most second-round "
                         "samples a step draws, a whole number >= 0, with second_round")
    if second_round is None:
        return
    if size is not None:
        raise ValueError(f"group_by(size={size}, second_round={second_round}): a second round "
                         "grows a group past its first samples, so its size is what arrived "
                         "of its prompt: drop size")
    if take is not None:
        raise ValueError(f"group_by(take={take}, second_round={second_round}): a quota of "
                         "groups and a second round both decide which groups train; use one")


def _adapt(ref: Ref, adapter: Collect | GroupBy) -> Ref:
    if not isinstance(ref, Ref):
        raise TypeError(f"{adapter} takes an op's output, got {ref!r}")
    if ref.adapter is not None:
        ref.flow._problem("double-adapter", f"{adapter} is applied to {ref}, which already has one",
                          op=ref.node, port=ref.port, fix="apply one adapter per wire")
    return attrs.evolve(ref, adapter=adapter)


class Flow(FlowGraph):
    """One step of a training or RL pipeline: typed operators and the wires between them."""

    # -- context -------------------------------------------------------------------------------
    def __enter__(self) -> Flow:
        self._token = ACTIVE_FLOW.set(self)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        ACTIVE_FLOW.reset(self._token)
        if exc_type is None:
            self.validate()

    # -- building ------------------------------------------------------------------------------
    def add_model(self, model: Model) -> Model:
        known = self.models.get(model.name)
        if known is not None and known != model:
            self._problem("duplicate-name", f"two different models are named {model.name!r}",
                          expected=repr(known), found=repr(model),
                          fix="give each model its own name, or reuse the same Model object")
        self.models.setdefault(model.name, model)
        return model

    def feedback(self, name: str, ptype: Any, *, chained: bool = False) -> Feedback:
        """Declare a value that a later op produces for the next step; `.bind(ref)` it there.
        `chained`: each step reads the value of the step just before it, even in an
        asynchronous run, where other feedback may be up to max_staleness steps older (a
        running estimate that folds in every step, as adaptive sampling's difficulty)."""
        fb = Feedback(self, name, port_type(ptype), chained=chained)
        if name in self.feedbacks:
            self._problem("duplicate-name", f"feedback name {name!r} is used twice",
                          fix="give each feedback its own name")
        self.feedbacks.setdefault(name, fb)
        return fb

    def add(self, operator: Operator, *, name: str | None = None, **config: Any) -> Node:
        """Add a node running `operator`; config keys must be ones the operator declares."""
        if not isinstance(operator, Operator):
            raise TypeError(f"flow.add takes an operator (an @op function or a ModelOp), got "
                            f"{operator!r}")
        node_name = name or operator.name
        # [Note: duplicate op names] A repeated name gets a private key (name~2) so that every
        # call stays in the graph and is checked; checks report one duplicate-name per name and
        # show users only the names they gave.
        key = _unique_key(node_name, self.nodes) if node_name in self.nodes else node_name
        node = Node(key, operator, self._config(operator, node_name, config), label=node_name,
                    origin=_call_site())
        self.nodes[key] = node
        if isinstance(getattr(operator, "model_ref", None), Model):
            self.add_model(operator.model_ref)
        return node

    def connect(self, src: Ref | Feedback | str, dst: str, *, adapter: Any = None,
                feedback: bool = False) -> None:
        """Wire an output ("node.port" or a Ref) to an input "node.port"."""
        target = _split_port(dst)
        if target is None:
            self._problem("bad-port-ref", f"flow.connect got the destination {dst!r}, which is "
                          "not 'op.port'", expected="'op.port'", found=repr(dst), fix=_PORT_FIX)
            return
        dst_node, dst_port = target
        if isinstance(src, (Ref, Feedback)) and src.flow is not self:
            self._foreign_ref(src, dst_node, dst_port)
        elif isinstance(src, Feedback):
            self._feedback_inputs.append((src, dst_node, dst_port))
        elif isinstance(src, Ref):
            self._wires.append(Wire(src.node, src.port, dst_node, dst_port,
                                    adapter or src.adapter, feedback))
        elif parsed := _split_port(src):
            self._wires.append(Wire(*parsed, dst_node, dst_port, adapter, feedback))
        else:
            self._misfed.add((dst_node, dst_port))
            self._problem("bad-port-ref", f"flow.connect got the source {src!r}, which is not "
                          "'op.port' or an op's output", op=dst_node, port=dst_port,
                          expected="'op.port' or an op's output", found=repr(src), fix=_PORT_FIX)

    def apply(self, operator: Operator, args: tuple, kwargs: dict, *, name: str | None) -> Any:
        """Add `operator` as a node, wire args/kwargs to its inputs, return its outputs."""
        config = {k: v for k, v in kwargs.items() if k not in operator.inputs}
        node = self.add(operator, name=name, **config)
        ports = operator.positional
        # An op whose declaration is broken has already been reported; counting its inputs
        # against a signature that is known to be wrong would only add noise.
        if len(args) > len(ports) and not operator.problems:
            self._problem("too-many-inputs", f"called with {len(args)} positional inputs but it "
                          f"has {len(ports)}: {', '.join(ports) or 'none'}", op=node.name,
                          fix="pass config as keywords; pass each input once")
        bound = {p: v for p, v in zip(ports, args) if p in operator.inputs}
        for port, value in kwargs.items():
            if port not in operator.inputs:
                continue
            if port in bound:
                self._problem("input-given-twice", f"input {port!r} is given both positionally "
                              "and by keyword", op=node.name, port=port,
                              fix=f"pass it once: {operator.name}({port}=...) or positionally")
                continue
            bound[port] = value
        for port, value in bound.items():
            self._wire_value(node, port, value)
        outs = Outputs((port, Ref(self, node.name, port)) for port in operator.outputs)
        if len(outs) == 1:
            return next(iter(outs.values()))
        return outs or None

    # -- checking and showing ------------------------------------------------------------------
    def check(self) -> list[Problem]:
        """Every problem in the flow, in declaration order; empty when the flow is valid."""
        return find_problems(self)

    def validate(self) -> Flow:
        problems = self.check()
        if problems:
            raise FlowError(self.name, problems)
        return self

    def describe(self, console: Any = None) -> None:
        """Print a summary (operators, ports, types, granularity, models) with rich."""
        from flowkit.dsl.render import describe  # rich loads only when a flow is shown

        describe(self, console)

    def to_dot(self) -> str:
        from flowkit.dsl.render import to_dot  # as describe: no rich until a flow is shown

        return to_dot(self)

    # -- internals -----------------------------------------------------------------------------
    def _config(self, operator: Operator, node_name: str, given: dict[str, Any]) -> dict:
        broken = {p.port for p in operator.problems}  # reported with the declaration
        for key in given:
            if key not in operator.config and key not in broken:
                self._problem("unknown-config", f"has no input or config named {key!r}",
                              op=node_name, port=key,
                              fix=suggest(key, [*operator.inputs, *operator.config]))
        config = {**operator.config, **{k: v for k, v in given.items() if k in operator.config}}
        for key, value in config.items():
            if value is REQUIRED:
                self._problem("missing-config", f"config {key!r} has no default and was not given",
                              op=node_name, port=key, fix=f"pass {key}=... when calling it")
        for key, known in getattr(operator, "choices", {}).items():
            if key in config and config[key] not in known:
                self._problem("unknown-choice", f"{key}={config[key]!r} is not one the executors "
                              "implement", op=node_name, port=key,
                              fix=suggest(str(config[key]),
                                          [k for k in known if isinstance(k, str)]))
        for key, (low, high) in getattr(operator, "ranges", {}).items():
            self._range_problem(node_name, key, config.get(key), low, high)
        return config

    def _range_problem(self, node: str, key: str, value: Any, low: Any, high: Any) -> None:
        if value is None:
            return
        allowed = " and ".join(part for part in (low is not None and f">= {low}",
                                                 high is not None and f"<= {high}") if part)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self._problem("bad-config", f"{key}={value!r} must be a number ({allowed})",
                          op=node, port=key, fix=f"pass a number: {key}={low if low else 1}")
        elif (low is not None and value < low) or (high is not None and value > high):
            self._problem("bad-config", f"{key}={value!r} is out of range: it must be {allowed}",
                          op=node, port=key, fix=f"pass {key} {allowed}")

    def _foreign_ref(self, src: Ref | Feedback, node: str, port: str) -> None:
        self._misfed.add((node, port))
        what = f"feedback {src.name!r}" if isinstance(src, Feedback) else str(src)
        self._problem(
            "foreign-ref", f"input is {what} of flow {src.flow.name!r}, but this op is in flow "
            f"{self.name!r}", op=node, port=port, expected=f"an output of flow {self.name!r}",
            found=f"{what} of flow {src.flow.name!r}",
            fix=f"a flow reads only its own ops' outputs: call the op producing {what} inside "
            f"`with Flow({self.name!r})` too, or build both in one flow")

    def _wire_value(self, node: Node, port: str, value: Any) -> None:
        if isinstance(value, (Ref, Feedback)):
            self.connect(value, f"{node.name}.{port}")
        else:
            self._misfed.add((node.name, port))
            self._problem("not-a-ref", f"input {port!r} got the plain value {value!r}",
                          op=node.name, port=port, expected="the output of another op",
                          found=type(value).__name__,
                          fix="wire inputs from ops' outputs; constants belong in config "
                          "(keyword-only parameters)")


_PORT_FIX = "name ports as 'op.port', e.g. flow.connect('generate.rollouts', 'score.rollout')"


def _split_port(text: Any) -> tuple[str, str] | None:
    """'node.port' -> (node, port); None when `text` is not of that form."""
    node, _, port = text.rpartition(".") if isinstance(text, str) else ("", "", "")
    return (node, port) if node and port else None


def _call_site() -> str | None:
    """`file.py:line` of the user code that is adding an op: the first frame outside the DSL."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("flowkit.dsl"):
        frame = frame.f_back
    if frame is None:
        return None
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"


def _unique_key(name: str, taken: dict) -> str:
    i = 2
    while f"{name}~{i}" in taken:
        i += 1
    return f"{name}~{i}"
