"""Operators: typed signatures, declared from annotated Python functions or model-op classes.

An operator is a declaration; calling it inside a `Flow` adds a node and wires its inputs. Problems
in a declaration (a missing annotation, a variadic parameter) are kept on the operator and reported
with the flow's other errors, so one build shows everything that is wrong.
"""

from __future__ import annotations

import contextvars
import inspect
import re
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar

import attrs

from flowkit.dsl.errors import Problem
from flowkit.dsl.hf import HF_BUILD, check_hf_config
from flowkit.dsl.lora import check_lora
from flowkit.dsl.types import PortType, Stream, port_type

__all__ = ["ACTIVE_FLOW", "FlowValue", "InputPort", "LossSpec", "Model", "ModelOp", "Operator",
           "REQUIRED", "Resumable", "op", "op_modules", "yields_many"]


# [Note: calls join a flow] Calling an op adds a node to the flow being built, which this module
# does not import (flow builds on it): the flow of the running `with Flow` block, else that of the
# call's first input. Whatever it is, it takes `apply(operator, args, kwargs, name=...)`.
ACTIVE_FLOW: contextvars.ContextVar[Any] = contextvars.ContextVar("flowkit_flow", default=None)


class FlowValue:
    """A value of a flow being built (an op's output, a feedback), which carries the flow."""

    __slots__ = ()
    flow: Any


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()
"""Marks a config key that has no default and must be given at the call."""

_RESERVED = frozenset({"name"})  # keywords of the call itself, so never a port or config key


_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


def _valid_name(_instance: object, attribute: attrs.Attribute, value: str) -> None:
    if not _NAME.match(value):
        raise ValueError(
            f"{attribute.name} must be a non-empty name of letters, digits, '_' or '-', "
            f"got {value!r}"
        )


# [Note: mixed precision] precision="bf16" is mixed precision as torchtitan and verl run it:
# the weights, their gradients and the optimizer states stay fp32 (the master copy), and every
# forward of the model (training stages, generation, scoring) runs under bf16 autocast, its
# backward in the dtypes autocast chose (executors/torch/train/deferred.py). A whole-model cast
# (config dtype="bfloat16") instead updates bf16 weights, where an RL-sized step is mostly
# lost: use it for frozen copies only. `flowkit bench train --precision bf16,fp32` compares.
PRECISIONS = ("fp32", "bf16")


SHARDINGS = ("fsdp",)


def check_sharding(model: Model) -> None:
    """A sharding there is, and not two of them at once."""
    if model.shard is not None and model.shard not in SHARDINGS:
        raise ValueError(f"Model {model.name!r}: shard must be one of {', '.join(SHARDINGS)} "
                         f"or None, not {model.shard!r}")
    if model.shard == "fsdp" and model.shard_optimizer:
        raise ValueError(f"Model {model.name!r}: shard='fsdp' shards the optimizer states "
                         "already, with the parameters and gradients: leave shard_optimizer "
                         "(ZeRO-1, --shard-optimizer) out")


def check_precision(precision: str, dtype: str, what: str) -> None:
    """A precision there is, and weights it can keep a master copy in."""
    if precision not in PRECISIONS:
        raise ValueError(f"{what}: precision must be one of {', '.join(PRECISIONS)}, not "
                         f"{precision!r} (fp16 needs loss scaling, which flowkit does not do)")
    if precision == "bf16" and dtype != "float32":
        raise ValueError(f"{what}: precision='bf16' keeps fp32 weights and computes in bf16; "
                         f"its config's dtype={dtype!r} would cast the weights themselves: "
                         "leave dtype out")


@attrs.frozen(kw_only=True)
class Model:
    """A model resource: ops that name the same Model share its weights.

    `build` is an import path ("package.module:factory") that executors resolve; flowkit itself
    never imports model code.
    """

    name: str = attrs.field(validator=_valid_name)
    build: str = attrs.field(converter=lambda b: HF_BUILD if b == "hf" else b)
    config: Mapping[str, Any] = attrs.field(factory=dict, hash=False)
    stages: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    tags: tuple[str, ...] = attrs.field(default=("gpu",), converter=tuple)
    # data parallel: this many copies of the `stages`-device pipeline train it, each on its
    # share of a step's microbatches, their gradients summed through torch.distributed
    # [Note: replicas in flowkit/runner/replicas.py]
    replicas: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    # ZeRO-1: each replica keeps the optimizer states of its share of the parameters only
    # [Note: sharded optimizer states in executors/torch/train/replicas.py]
    shard_optimizer: bool = False
    # "fsdp": each replica of a stage keeps its rows of the parameters, gradients and optimizer
    # states between steps [Note: FSDP within a stage in executors/torch/train/fsdp.py];
    # None: every replica keeps the whole stage
    shard: str | None = None
    # low-rank adapters: only they train, sync to generation and save [Note: LoRA in
    # flowkit/dsl/lora.py]; None trains every weight
    lora: Mapping[str, Any] | None = attrs.field(default=None, hash=False)
    # the compute precision of its forwards, training and generation alike [Note: mixed
    # precision]: "fp32", or "bf16" (fp32 weights, gradients and optimizer states)
    precision: str = "fp32"
    # several sequences to a row in its training, scoring and critic forwards, each with its own
    # positions and attending only within itself (executors/torch/models/packing.py): far fewer
    # padded tokens on long-tailed lengths; its forward must take `positions`
    packing: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def __attrs_post_init__(self) -> None:  # checked and normalized once the name is known
        check_sharding(self)
        object.__setattr__(self, "lora", check_lora(self.lora, model=self.name))
        check_precision(self.precision, self.config.get("dtype", "float32"),
                        f"Model {self.name!r}")
        if self.lora is not None and self.config.get("value_head"):
            raise ValueError(f"Model {self.name!r}: lora trains the adapters only, and a value "
                             "head (value_head=True: a critic, a reward model) starts untrained: "
                             "train it whole (no lora)")

    @build.validator
    def _check_build(self, _attribute: attrs.Attribute, value: str) -> None:
        module, _, factory = value.partition(":")
        if not module or not factory:
            raise ValueError(
                f"Model {self.name!r}: build must be 'package.module:factory' (or 'hf' for a "
                f"Hugging Face causal LM), got {value!r}"
            )

    @config.validator
    def _check_config(self, _attribute: attrs.Attribute, value: Mapping[str, Any]) -> None:
        if self.build == HF_BUILD:  # a model directory that cannot work fails here, not later
            try:
                check_hf_config(value)
            except ValueError as exc:
                raise ValueError(f"Model {self.name!r}: {exc}") from None


@attrs.frozen
class InputPort:
    name: str
    type: PortType
    required: bool = True


class Operator:
    """A typed signature: named input ports, named output ports, config keys with defaults."""

    kind: str = "python"

    def __init__(
        self,
        *,
        name: str,
        inputs: dict[str, InputPort],
        outputs: dict[str, PortType],
        config: dict[str, Any],
        doc: str = "",
        tags: tuple[str, ...] = (),
        problems: list[Problem] | None = None,
        positional: Sequence[str] | None = None,
    ) -> None:
        self.name = name
        self.inputs = inputs
        # The order positional arguments bind in: the inputs, plus any parameter whose
        # declaration is broken (reported in `problems`), so later arguments still bind right.
        self.positional = tuple(inputs if positional is None else positional)
        self.outputs = outputs
        self.config = config
        self.doc = doc
        self.tags = tuple(tags)
        self.problems = list(problems or [])
        # A source's companion op, called beside it with the same config to report its
        # progress (dataflows/datasets.py: dataset_prompts' epoch); flows that take a source
        # add it (dataflows/rl/front.py).
        self.reporter: Operator | None = None

    @property
    def model(self) -> str | None:
        return None

    def __call__(self, *args: Any, name: str | None = None, **kwargs: Any) -> Any:
        """Add this op to the flow being built [Note: calls join a flow], wired to the given
        inputs; returns its output refs. An input from another flow is reported as a foreign-ref."""
        return _flow_of_call(self, args, kwargs).apply(self, args, kwargs, name=name)

    def __repr__(self) -> str:
        ins = ", ".join(f"{p.name}: {p.type}" for p in self.inputs.values())
        outs = ", ".join(f"{n}: {t}" for n, t in self.outputs.items())
        return f"<{type(self).__name__} {self.name}({ins}) -> ({outs})>"


def _flow_of_call(operator: Operator, args: tuple, kwargs: dict) -> Any:
    active = ACTIVE_FLOW.get()
    inputs = (value.flow for value in (*args, *kwargs.values()) if isinstance(value, FlowValue))
    flow = active if active is not None else next(inputs, None)
    if flow is None:
        raise RuntimeError(f"op {operator.name!r} was called outside a flow: call ops inside "
                           "`with Flow('name') as flow:`, or add them with flow.add(...)")
    return flow


class FunctionOp(Operator):
    """An operator whose body is a plain Python function.

    Positional parameters are input ports, keyword-only parameters are config. A Stream or bare
    input means the function is called per item (per group for Grouped); a Batch input means once
    per step with the list of all items. A bare return type is one item per call; Stream[T]
    returns an iterable of items; Batch[T] returns the whole list.

    `check`, when given, is called with a call's config (its defaults and what the call gave)
    when the flow is validated, before anything runs: a ValueError it raises is reported as
    that call's problem (e.g. a data file without the field the config names).
    """

    def __init__(self, fn: Callable, *, name: str | None, outputs: Mapping[str, Any] | None,
                 output: str, tags: tuple[str, ...],
                 check: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.fn = fn
        _OP_MODULES.add(fn.__module__)  # its records may travel [Note: record registry]
        self.check = check
        op_name = name or fn.__name__
        problems: list[Problem] = []
        hints = _type_hints(fn, op_name, problems)
        inputs, config = _parameters(fn, hints, op_name, problems)
        outs = _outputs(fn, hints, outputs, output, op_name, problems)
        # the annotations as written: Stream[T] returns many items per call, a bare T one
        self.declared_outputs = dict(outputs) if outputs is not None else None
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        positional = [p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds]
        super().__init__(name=op_name, inputs=inputs, outputs=outs, config=config,
                         doc=inspect.getdoc(fn) or "", tags=tags, problems=problems,
                         positional=positional)

    @property
    def target(self) -> str:
        """Where executors import the function from."""
        return f"{self.fn.__module__}:{self.fn.__qualname__}"

    def node_problems(self, flow: Any, node: Any) -> list[Problem]:
        """The problem `check` finds in this call's config (none without a check, or while a
        config key is missing: that is reported already)."""
        config = dict(node.config)
        if self.check is None or any(value is REQUIRED for value in config.values()):
            return []
        try:
            self.check(config)
        except ValueError as exc:
            return [Problem(rule="bad-config", op=node.name, message=str(exc))]
        return []


# Modules in which this process declared @op functions: the code a run is made of, whose attrs
# records values on the wire may hold ([Note: record registry] in flowkit/wire/serialize.py).
_OP_MODULES: set[str] = set()


def op_modules() -> frozenset[str]:
    """The modules of every @op function declared in this process so far."""
    return frozenset(_OP_MODULES)


def op(
    fn: Callable | None = None,
    *,
    name: str | None = None,
    output: str = "out",
    outputs: Mapping[str, Any] | None = None,
    tags: tuple[str, ...] = (),
    check: Callable[[dict[str, Any]], None] | None = None,
) -> Any:
    """Declare an operator from an annotated function: ``@op`` or ``@op(outputs={...})``.

    `output` names the single output port; `outputs` declares several, the function then returning
    a mapping from port name to value. `tags` are executor tags the op needs to run on. `check`
    validates a call's config before the flow runs (FunctionOp).
    """

    def wrap(f: Callable) -> FunctionOp:
        return FunctionOp(f, name=name, outputs=outputs, output=output, tags=tuple(tags),
                          check=check)

    return wrap(fn) if fn is not None else wrap


def _type_hints(fn: Callable, op_name: str, problems: list[Problem]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception as exc:  # NameError for an undefined forward reference, and similar
        problems.append(Problem(
            rule="bad-annotation", op=op_name, message=f"its annotations cannot be resolved: {exc}",
            fix="import every type its annotations name at module level"))
        return {}


def _parameters(fn: Callable, hints: dict[str, Any], op_name: str, problems: list[Problem]):
    inputs: dict[str, InputPort] = {}
    config: dict[str, Any] = {}
    for param in inspect.signature(fn).parameters.values():
        if param.name in _RESERVED:
            problems.append(Problem(
                rule="bad-signature", op=op_name, port=param.name,
                message=f"{param.name!r} is reserved for the node name of a call",
                fix="rename the parameter"))
        elif param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            problems.append(Problem(
                rule="bad-signature", op=op_name, port=param.name,
                message="variadic parameters cannot be ports",
                fix="declare one named, annotated parameter per input"))
        elif param.kind is param.KEYWORD_ONLY:
            config[param.name] = REQUIRED if param.default is param.empty else param.default
        elif param.name not in hints:
            problems.append(Problem(
                rule="missing-annotation", op=op_name, port=param.name,
                message="input has no type annotation",
                fix=f"annotate it, e.g. `{param.name}: Stream[Rollout]`"))
        else:
            inputs[param.name] = _input_port(param, hints[param.name], op_name, problems)
    return inputs, config


def _input_port(param: inspect.Parameter, hint: Any, op_name: str,
                problems: list[Problem]) -> InputPort:
    try:
        ptype = port_type(hint)
    except TypeError as exc:
        problems.append(Problem(rule="bad-annotation", op=op_name, port=param.name,
                                message=str(exc), fix="use Stream[T], Batch[T], Grouped[T] or T"))
        ptype = port_type(Any)
    return InputPort(param.name, ptype, required=param.default is param.empty)


def _outputs(fn: Callable, hints: dict[str, Any], outputs: Mapping[str, Any] | None,
             output: str, op_name: str, problems: list[Problem]) -> dict[str, PortType]:
    if outputs is not None:
        return {port: port_type(tp) for port, tp in outputs.items()}
    if "return" not in hints:
        problems.append(Problem(
            rule="missing-annotation", op=op_name, port="return",
            message="the function has no return annotation",
            fix="annotate what it returns (`-> Stream[Scored]`), or `-> None` if nothing"))
        return {}
    if hints["return"] is type(None):
        return {}
    return {output: port_type(hints["return"])}


@attrs.frozen(kw_only=True)
class Workload:
    """How much work one call of a ModelOp is predicted to be, so the runner can spread its
    calls over the executors able to run them by predicted work rather than by count
    [Note: length-aware dispatch in flowkit/runner/balance.py]. Each name is the flow
    library's, so the engine names none: for generation, a call (a prompt) yields
    config[count] items (n samples) of at most config[budget] work each (max_new_tokens); the
    call's input item is known across steps by its field `key` (prompt_id), and each output
    item's field `size` says how much work it took (its response length)."""

    key: str
    count: str
    budget: str
    size: str


@attrs.frozen(kw_only=True)
class Resumable:
    """A ModelOp whose calls can be cut short at a token boundary and continued later from
    what they made (a finished item given back passes through): partial rollouts carry a
    step's unfinished calls into the next, and a checkpoint of an asynchronous run replays a
    step's calls from their saved outputs ([Note: partial rollouts] in
    flowkit/runner/partial.py). Each name is the flow library's, so the engine names none:
    a call's config[take] says how many of a step's calls the step takes (None: all, no
    partial rollouts); a continued call is told in config[version_floor] the oldest weights
    version its items may keep; config[request] names a call so that the executor op
    `abort_op` can cut it short (`abort_config`); config[stale] (optional) says what becomes of
    a continued call's items older than that floor: "drop" (its group dropped whole) or any
    other value (they are made again)."""

    take: str
    version_floor: str
    request: str
    abort_op: str
    stale: str | None = None

    @staticmethod
    def abort_config(requests: Sequence[str]) -> dict[str, Any]:
        """The config of an `abort_op` task that cuts the named calls short; it returns
        [items, tokens] cut."""
        return {"action": "abort", "requests": list(requests)}


@attrs.frozen(kw_only=True)
class LossSpec:
    """What the runner needs to know of the loss a training op's config names, so it names
    no loss. config[key] names it; `names` are the losses the executors implement, `knobs`
    the config keys their pipeline ops read besides the name. A loss in `sum_form` is
    backpropagated as a sum over tokens that the optimizer step divides by the step's total,
    so a microbatch needs no batch total and may be formed before the batch is complete
    ([Note: streamed microbatches] in flowkit/runner/model_training.py). A loss in `proximal`
    weighs samples of older weights against a proximal policy when the run is asynchronous:
    the runner turns config[proximal_knob] on ([Note: asynchronous steps] in
    flowkit/runner/flowrun.py)."""

    key: str
    names: frozenset[str] = attrs.field(converter=frozenset)
    knobs: tuple[str, ...] = attrs.field(converter=tuple)
    sum_form: frozenset[str] = attrs.field(converter=frozenset)
    proximal: frozenset[str] = attrs.field(converter=frozenset, default=())
    proximal_knob: str | None = None

    def settings(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The entries of `config` the loss's pipeline ops are told: the name and knobs."""
        return {k: v for k, v in config.items() if k == self.key or k in self.knobs}

    def summed(self, config: Mapping[str, Any]) -> bool:
        return config.get(self.key) in self.sum_form

    def unknown(self, config: Mapping[str, Any]) -> str | None:
        """The loss `config` names if the executors implement no such loss."""
        name = config.get(self.key)
        return None if name is None or name in self.names else name

    def with_proximal(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """`config` for a run whose samples may be stale: the proximal policy on, if its
        loss takes one."""
        if self.proximal_knob is None or config.get(self.key) not in self.proximal:
            return dict(config)
        return {**config, self.proximal_knob: True}


class ModelOp(Operator):
    """An operator run by an executor that holds a Model, declared as a class:

        class Generate(ModelOp):
            '''Sample responses to prompts.'''
            executor_op = "generate"
            inputs = {"prompts": Stream[Prompt]}
            outputs = {"rollouts": Stream[Rollout]}
            config = {"n": 1, "temperature": 1.0}

    `Generate(actor)` binds it to a model (a Model, or a model's name declared in the flow).
    It runs on executors with the model's tags, or with `tags` when given: e.g. generation on
    `rollout` executors while the model trains on `train` ones (the weights sync each step).

    `lowering` tells the planner how its calls become tasks: None, like any op, by its inputs'
    granularity; "pipeline", microbatches under a pipeline schedule (F, B, W per stage); "step",
    one task per pipeline stage after that stage's W ops. `many_per_call`: one call yields many
    items (n samples per prompt), each its own item downstream, rather than one. `fan_out`:
    (config key, field) when a call yields config[key] items that share the value of `field`
    (n samples of one prompt_id), so `group_by(field, size=...)` downstream can be checked
    against it. `workload`: how to predict a call's work (a Workload), for ops whose calls
    differ widely in cost (generation: long-tailed lengths). `traced`: a field (or property) of
    its output items whose value a trace records for each item, in the span of the call that
    made it (a Rollout's version_span); small plain data, as it rides in every completion.
    `resumable`: its calls can be cut short and continued (a Resumable: generation), which
    partial rollouts and the checkpoints of asynchronous runs rely on. `loss_spec`: what the
    runner needs to know of the loss its config names (a LossSpec: a backprop's). `scores`:
    each call scores its items with the whole model, so a run may lend it training executors'
    pipeline bubbles when the model is one the flow does not train ([Note: bubble filling] in
    flowkit/runner/bubble_fill.py: log-probs, values, a reward model's scores).
    `item_tokens`: a field (or property) of its first input's items that says each item's
    tokens, reported as it is made, so that config `microbatch_tokens` can form microbatches
    by tokens ([Note: token-budget microbatches] in flowkit/runner/token_microbatches.py).
    `engine_key`: the config key naming the rollout engine its calls run on (generation's
    `engine`), which a run's `rollout_engine` (--rollout-engine) sets on every such op.
    `choices`: config keys whose value must be one of a known set (a loss, a
    schedule kind); `ranges`: numeric config keys and their (lowest, highest) allowed values,
    None for no bound (None as a value passes: "not set"). Both are checked when the flow is
    built. What they cannot say (how the node must be wired, a config changed after the
    build) a subclass checks in `node_problems`, which the flow's validation calls per node.
    """

    executor_op: ClassVar[str] = ""
    lowering: ClassVar[str | None] = None
    many_per_call: ClassVar[bool] = False
    fan_out: ClassVar[tuple[str, str] | None] = None
    workload: ClassVar[Workload | None] = None
    traced: ClassVar[str | None] = None
    resumable: ClassVar[Resumable | None] = None
    loss_spec: ClassVar[LossSpec | None] = None
    scores: ClassVar[bool] = False
    item_tokens: ClassVar[str | None] = None
    engine_key: ClassVar[str | None] = None
    choices: ClassVar[dict[str, Collection[str]]] = {}
    ranges: ClassVar[dict[str, tuple[float | None, float | None]]] = {}
    inputs: ClassVar[dict[str, Any]] = {}
    outputs: ClassVar[dict[str, Any]] = {}
    config: ClassVar[dict[str, Any]] = {}
    optional: ClassVar[tuple[str, ...]] = ()  # inputs that may stay unwired

    def __init__(self, model: Model | str, *, name: str | None = None,
                 tags: tuple[str, ...] = ()) -> None:
        cls = type(self)
        self.model_ref = model
        self.kind = cls.executor_op or cls.__name__.lower()
        super().__init__(
            name=name or self.kind,
            inputs={port: InputPort(port, port_type(tp), port not in cls.optional)
                    for port, tp in cls.inputs.items()},
            outputs={port: port_type(tp) for port, tp in cls.outputs.items()},
            config=dict(cls.config),
            doc=inspect.getdoc(cls) or "",
            tags=tags,
        )

    @property
    def model(self) -> str:
        return self.model_ref.name if isinstance(self.model_ref, Model) else str(self.model_ref)

    def node_problems(self, flow: Any, node: Any) -> list[Problem]:
        """Problems of one call of this op (`node`) in `flow` (a FlowGraph): its config as the
        node holds it now, the nodes it is wired to. None by default."""
        return []


def yields_many(operator: Operator) -> tuple[bool, ...]:
    """Per output: does one call return many items (Stream[T], Batch[T]) or one (a bare T)?"""
    if isinstance(operator, ModelOp):
        return (operator.many_per_call,) * len(operator.outputs)
    fn = getattr(operator, "fn", None)
    hints = typing.get_type_hints(fn) if fn is not None else {}
    declared = getattr(operator, "declared_outputs", None)
    annotations = declared or {name: hints.get("return") for name in operator.outputs}
    return tuple(_is_collection(annotations.get(name)) for name in operator.outputs)


def _is_collection(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    return origin is not None and origin.__name__ in ("Stream", "Batch") and (
        origin.__module__ == Stream.__module__)
