"""The op table: the only way an executor runs code. An instruction names an op; the executor
looks the name up here, and an unknown name is an error reply, never an import or an eval.

Built-in ops live here; executor kinds add theirs (`executors.sim`, `executors.torch`), and other
packages plug in through the entry-point group `flowkit.ops`: each entry point names a function
`register(table: OpTable) -> None`.
"""

from __future__ import annotations

import functools
import importlib
import sys
import time
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, Protocol

import attrs

__all__ = ["Background", "Deferred", "OpContext", "OpTable", "builtin_ops", "installed_entries",
           "load_plugin_ops"]

Op = Callable[..., Any]  # op(ctx, *inputs, **config) -> output, or a tuple of outputs


@attrs.define
class OpContext:
    """What an op may know about the executor running it.

    [Note: streaming ops] When the task streams (the controller asked for each item as it is
    ready), `emit` is set while the op runs: an op whose result is a list of items calls
    `emit(item)` for each one the moment it is ready (in the order of the list it returns),
    and the item leaves for the controller and its consumers at once. Ops that cannot stream
    ignore it: their items then arrive together, when the op returns.
    """

    name: str
    device: str
    tags: tuple[str, ...]
    state: dict[str, Any] = attrs.field(factory=dict)  # per-executor state ops share: models, RNG
    emit: Callable[[Any], None] | None = None  # set for a streaming task [Note: streaming ops]
    # long-lived work the executor steps between messages, by name [Note: deferred ops]
    background: dict[str, Background] = attrs.field(factory=dict)


class Background(Protocol):
    """Work that goes on beyond the op that started it (a rollout engine's decoding loop).

    The executor calls `step()` whenever `busy()`, between reading messages and running tasks,
    with the sockets served meanwhile as during an op: each step must be short (one decoding
    iteration), so that new tasks, weight loads and peers' requests get in between."""

    def busy(self) -> bool: ...
    def step(self) -> None: ...


class Deferred:
    """[Note: deferred ops] The result of an op that handed its work to a Background (a
    request given to the rollout engine): the op returns it at once, the executor keeps the
    task open and runs other tasks, and the Background later calls `emit(item)` for each item
    of a streaming task, then `done(result)` or `fail(error)`, from inside its `step()`. If the
    controller cancels the task, `cancelled` is set (from any thread, so the Background only
    reads it in its next step) and `on_cancel` is called."""

    def __init__(self, on_cancel: Callable[[], None] | None = None) -> None:
        self.cancelled = False
        self.finished = False
        self.on_cancel = on_cancel
        self._sink: Any = None  # the executor's side, bound when the op returns this

    def bind(self, sink: Any) -> None:
        self._sink = sink

    def emit(self, item: Any) -> None:
        self._sink.emit(item)

    def done(self, result: Any) -> None:
        self._finish()
        self._sink.done(result)

    def fail(self, error: BaseException) -> None:
        self._finish()
        self._sink.fail(error)

    def cancel(self) -> None:
        self.cancelled = True
        if self.on_cancel is not None:
            self.on_cancel()

    def _finish(self) -> None:
        if self.finished:
            raise RuntimeError("a deferred task finishes once")
        self.finished = True


class OpTable:
    """[Note: batched forms] A batched task [Note: batched tasks in flowkit/wire/task.py] runs
    its op once per item, unless the op was registered with a `batched` form: that is called
    once, with a list (one value per item) in place of each per-item input and the shared
    inputs as they are, and returns the list of the items' results, in order. A model op's
    batched form runs one forward on the items instead of one each."""

    def __init__(self) -> None:
        self._ops: dict[str, Op] = {}
        self._batched: dict[str, Op] = {}
        self._merges: set[str] = set()
        self.op_end_hooks: list[Callable[[OpContext], None]] = []

    def on_op_end(self, hook: Callable[[OpContext], None]) -> None:
        """Call `hook(ctx)` after each op returns, before the executor reads the clock that ends
        its time: a kind whose ops queue work on a device waits for it there (the torch kind:
        [Note: device time] in executors/torch/device.py)."""
        if hook not in self.op_end_hooks:
            self.op_end_hooks.append(hook)

    def register(self, name: str, fn: Op | None = None, *, batched: Op | None = None,
                 merges: bool = False) -> Any:
        """`table.register("noop", fn)` or as a decorator `@table.register("noop")`;
        `batched`: the op's form on lists of items [Note: batched forms]; `merges`: its
        batched tasks waiting together may run as one call, the op's results being the same
        whichever items share it [Note: merged tasks in executors/tasks.py]."""

        def add(op: Op) -> Op:
            if name in self._ops and self._ops[name] is not op:
                raise ValueError(f"op {name!r} is already registered")
            self._ops[name] = op
            if batched is not None:
                self._batched[name] = batched
                if merges:
                    self._merges.add(name)
            return op

        return add(fn) if fn is not None else add

    def get(self, name: str) -> Op | None:
        return self._ops.get(name)

    def batched(self, name: str) -> Op | None:
        """The op's batched form, if it has one [Note: batched forms]."""
        return self._batched.get(name)

    def merges(self, name: str) -> bool:
        """Whether the op's waiting batched tasks may run as one call [Note: merged tasks]."""
        return name in self._merges

    def names(self) -> list[str]:
        return sorted(self._ops)

    def __contains__(self, name: str) -> bool:
        return name in self._ops


def _noop(ctx: OpContext, *inputs: Any) -> None:
    return None


def _identity(ctx: OpContext, value: Any, *, seconds: float = 0.0) -> Any:
    """The value itself, after `seconds` (work to stand in for, in benchmarks)."""
    if seconds > 0:
        time.sleep(seconds)
    return value


def _sleep(ctx: OpContext, *inputs: Any, seconds: float = 0.0) -> None:
    time.sleep(seconds)


def _clock(ctx: OpContext, *inputs: Any) -> float:
    """When the op ran (monotonic seconds): lets tests see the order tasks ran in."""
    return time.monotonic()


def _fail(ctx: OpContext, *inputs: Any, message: str = "failed on purpose") -> None:
    raise RuntimeError(message)


def _reset_executor(ctx: OpContext, *inputs: Any) -> int:
    """Forget what earlier tasks left in this executor's context (models, rollout engines,
    replica groups: ctx.state and ctx.background) and seed the random generators from the OS as
    a fresh process does, so that executors outlive one user (runs one after another on a shared
    controller, a test suite's pool) without the next one seeing it. Refused while a background
    still has work: the tasks it serves would never end. Returns how many entries it dropped."""
    import random
    import sys

    working = sorted(name for name, background in ctx.background.items() if background.busy())
    if working:
        raise RuntimeError(f"reset_executor while {', '.join(working)} still work: wait for "
                           "their tasks (or cancel them) first")
    dropped = len(ctx.state) + len(ctx.background)
    ctx.state.clear()
    ctx.background.clear()
    random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    return dropped


class _Countdowns:
    """The background of `countdown` tasks: each step gives every live task its next number."""

    def __init__(self) -> None:
        self.live: list[list] = []  # [deferred, next number, numbers left, seconds a step]

    def busy(self) -> bool:
        return bool(self.live)

    def step(self) -> None:
        time.sleep(max((entry[3] for entry in self.live), default=0.0))
        for entry in list(self.live):
            deferred, number, left, _ = entry
            if deferred.cancelled:
                self.live.remove(entry)
            elif left == 0:
                self.live.remove(entry)
                deferred.done(list(range(number)))
            else:
                deferred.emit(number)
                entry[1:3] = [number + 1, left - 1]


def _countdown(ctx: OpContext, *inputs: Any, count: int = 3, seconds: float = 0.0) -> Deferred:
    """0 .. count-1, one number a background step (`seconds` each), every task that is live
    stepping together: the smallest deferred, streaming op [Note: deferred ops], for tests."""
    countdowns = ctx.background.setdefault("countdown", _Countdowns())
    deferred = Deferred()
    countdowns.live.append([deferred, 0, int(count), float(seconds)])
    return deferred


def _python(ctx: OpContext, *inputs: Any, target: str, config: dict | None = None,
            ports: list[str] | None = None, outputs: list[str] | None = None,
            many: list[bool] | None = None) -> Any:
    """Run a flowkit `@op` function by its import path. Only functions declared with @op run:
    the path must resolve to a FunctionOp, so a message cannot call arbitrary code.

    `ports` names the inputs (passed by keyword, so an optional port may be left out);
    `outputs` names the ports of a multi-output op, whose function returns a mapping; `many`
    marks the outputs that are Streams or Batches: their iterables become lists here, since a
    generator cannot leave the process."""
    function = _function_op(target)
    if ports is not None:
        result = function.fn(**dict(zip(ports, inputs, strict=True)), **(config or {}))
    else:
        result = function.fn(*inputs, **(config or {}))
    if ctx.emit is not None and many == [True] and result is not None:
        return _streamed(ctx.emit, function, outputs or list(function.outputs), result)
    if outputs is not None and len(outputs) > 1:
        if not isinstance(result, dict) or set(result) != set(outputs):
            raise TypeError(f"{target} declares outputs {outputs} and must return a mapping "
                            f"with those keys, got {type(result).__name__}")
        result = tuple(result[name] for name in outputs)
    if many is None:
        return result
    values = result if isinstance(result, tuple) and len(many) > 1 else (result,)
    values = tuple(list(v) if m and v is not None else v for v, m in zip(values, many))
    _check_returned(function, outputs or list(function.outputs), values, many)
    return values if len(values) > 1 else values[0]


def _streamed(emit: Callable[[Any], None], function: Any, ports: list[str], items: Any) -> list:
    """A one-output Stream op's items, each checked and emitted as the function yields it
    [Note: streaming ops]."""
    done = []
    for item in items:
        _check_returned(function, ports, ([item],), [True])
        emit(item)
        done.append(item)
    return done


def _check_returned(function: Any, ports: list[str], values: tuple, many: list[bool]) -> None:
    """An output that is not what the op's signature promises fails here, naming this op,
    not later in the op that reads it. Only plain classes are checked (a record, float, str):
    an isinstance per item; a tensor spec says what its tensors hold, which is left to them."""
    from flowkit.dsl import Tensor

    for port, value, each in zip(ports, values, many):
        promised = function.outputs[port]
        item = promised.item
        if not isinstance(item, type) or item is object or issubclass(item, Tensor) or (
                value is None):
            continue
        accepted = (int, float) if item is float else item  # an int is a fine float
        wrong = next((v for v in (value if each else [value]) if not isinstance(v, accepted)),
                     _NOTHING_WRONG)
        if wrong is not _NOTHING_WRONG:
            shown = repr(wrong)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise TypeError(f"@op {function.name!r} returned {type(wrong).__name__} {shown} "
                            f"for output {port!r}, but its signature promises {promised}")


_NOTHING_WRONG = object()


def _function_op(target: str) -> Any:
    from flowkit.dsl.operators import FunctionOp

    module_name, _, qualname = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:  # which, and where it looked [Note: shipped code in
        # flowkit/runner/flowcode.py]
        raise ModuleNotFoundError(
            f"@op {target}: no module {exc.name!r} on this executor (searched "
            f"{', '.join(sys.path[:6])}, ...): a run ships the modules of its flow that it "
            "finds; give RunConfig(code=[its folder]) for one it cannot", name=exc.name) from None
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, FunctionOp):
        raise TypeError(f"{target} is not a flowkit @op function; refusing to run it")
    return obj


def builtin_ops() -> OpTable:
    table = OpTable()
    table.register("noop", _noop)
    table.register("identity", _identity)
    table.register("sleep", _sleep)
    table.register("fail", _fail)
    table.register("reset_executor", _reset_executor)
    table.register("clock", _clock)
    table.register("countdown", _countdown)
    table.register("python", _python)
    table.register("make_tensor", _make_tensor)
    table.register("nbytes", _nbytes)
    return table


@functools.cache
def installed_entries(group: str) -> tuple[Any, ...]:
    """The entry points of `group` the installed packages declare, read once a process (a fork
    server reads them for its children): a read of every package's metadata, 2 % of a
    ten-step executor's CPU (py-spy, as for the fork server's finalizers)."""
    return tuple(entry_points(group=group))


def load_plugin_ops(table: OpTable) -> list[str]:
    """Let installed packages add ops (entry-point group `flowkit.ops`); returns their names."""
    loaded = []
    for entry in installed_entries("flowkit.ops"):
        entry.load()(table)
        loaded.append(entry.name)
    return loaded


def _make_tensor(ctx: OpContext, *inputs: Any, nbytes: int, dtype: str = "uint8") -> Any:
    """A tensor of `nbytes` bytes whose byte i is i % 251: made on the executor, so transfer
    benchmarks and tests move data the controller never held."""
    import torch

    pattern = torch.arange(251, dtype=torch.uint8)
    data = pattern.repeat(nbytes // 251 + 1)[:nbytes].clone()
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {dtype!r}")
    return data.view(torch_dtype)


def _nbytes(ctx: OpContext, value: Any) -> int:
    """The size of a tensor's, array's or bytes' data, without reading it."""
    if hasattr(value, "element_size"):
        return value.numel() * value.element_size()
    if hasattr(value, "nbytes"):
        return int(value.nbytes)
    return len(value)
