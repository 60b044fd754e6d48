"""What an executor knows of one task (its TaskSpec, decoded and checked by
flowkit/wire/task.py, and how far it has got), and how it describes a task's outputs to the
controller (executors/process.py runs them)."""

from __future__ import annotations

from typing import Any

import attrs

from executors.optable import Deferred
from executors.outbox import packed
from flowkit.wire.refs import object_ids
from flowkit.wire.serialize import SerializeError, nbytes_of, pack
from flowkit.wire.task import TaskSpec

__all__ = ["MERGED_ITEMS", "ItemFailed", "Task", "check_streamed", "failure_text", "merged",
           "merges_with", "run_items", "shares_of", "split_outputs", "summarize_completion",
           "summarize_output"]

_INLINE_LIMIT = 2048  # outputs whose packed form is this small ride in the completion message
_NONE_BODY = pack(None)[0]


class Task:
    """A task on this executor: its spec, its op's function, and how far it has got.

    [Note: lanes] Tasks of one lane run in the order they arrived, like a CUDA stream: a
    pipeline schedule's per-device order is a lane."""

    __slots__ = ("spec", "fn", "missing", "plain", "streamed", "start", "results", "answered",
                 "credited", "busy")

    def __init__(self, spec: TaskSpec, fn: Any) -> None:
        self.spec, self.fn = spec, fn
        self.missing = 0  # inputs not here yet
        self.plain = all(type(i) is int for i in spec.inputs)  # whole objects: the usual
        self.streamed: list[dict] = []  # the descriptions of the items it streamed
        # a batched task: its items' outputs as they finish, and how many were answered early
        # [Note: early items]
        self.results: list = []
        self.answered = 0
        self.start = 0.0
        self.credited = 0  # a streaming task's items the controller credited back
        # seconds it held the op thread, when not its span: a deferred op's, a merged share
        # [Note: placement by load in flowkit/runtime/dispatch.py]
        self.busy: float | None = None

    def object_ids(self) -> list[int]:
        if self.plain:
            return self.spec.inputs
        return [i for ref in self.spec.inputs for i in object_ids(ref)]


def split_outputs(result: Any, count: int, op: str) -> list:
    if count == 1:
        return [result]
    if count == 0:
        return []
    if not isinstance(result, (tuple, list)) or len(result) != count:
        raise TypeError(f"op {op!r} must return {count} outputs for this task, got "
                        f"{type(result).__name__}")
    return list(result)


def run_items(task: Task, ctx: Any, args: list, batched: Any) -> list:
    """A batched task's outputs, the items' in order [Note: batched tasks in
    flowkit/wire/task.py]: its op's batched form called once on the lists, or the op on each
    item [Note: batched forms in executors/optable.py]. An item that fails fails the task,
    which says which item it was."""
    spec = task.spec
    count, config = spec.items, spec.config
    if batched is not None:
        results = batched(ctx, *args, **config)
        if not isinstance(results, (list, tuple)) or len(results) != count:
            size = len(results) if isinstance(results, (list, tuple)) else type(results).__name__
            raise TypeError(f"op {spec.op!r}'s batched form returned {size} for {count} items: "
                            "it returns one result per item, in order")
        outputs = len(spec.outputs) // count
        task.results = [value for result in results
                        for value in _item_outputs(result, outputs, spec.op)]
        return task.results
    per_item, fn, outputs = frozenset(spec.per_item), task.fn, len(spec.outputs) // count
    for i in range(count):
        row = [arg[i] if j in per_item else arg for j, arg in enumerate(args)]
        try:
            result = fn(ctx, *row, **config)
        except Exception as exc:
            raise ItemFailed(exc, i, count) from exc
        # one extend an item: the executor's watch may answer the items done so far meanwhile
        # [Note: early items]
        task.results.extend(_item_outputs(result, outputs, spec.op))
    return task.results


def _item_outputs(result: Any, outputs: int, op: str) -> list:
    if isinstance(result, Deferred):
        raise TypeError(f"op {op!r} hands its work to a background (deferred): it cannot run "
                        "batched")
    return split_outputs(result, outputs, op)


class ItemFailed(Exception):
    """Item `index` of a batched task's `count` failed with `error`."""

    def __init__(self, error: Exception, index: int, count: int) -> None:
        super().__init__(error, index, count)
        self.error, self.index, self.count = error, index, count


def failure_text(exc: Exception) -> str:
    """What a failed task's completion says of its error: the op's own, and for a batched task
    which of its items raised it."""
    if isinstance(exc, ItemFailed):
        return (f"{type(exc.error).__name__}: {exc.error} (item {exc.index} of the {exc.count} "
                "this batched task ran)")
    return f"{type(exc).__name__}: {exc}"


def check_streamed(task: Task, result: Any) -> None:
    """A streaming op returns the list of the items it emitted, every one of them [Note:
    streaming ops]; emitting none and returning a list is an op that does not stream."""
    if not task.streamed:
        return
    if not isinstance(result, (list, tuple)) or len(result) != len(task.streamed):
        size = len(result) if isinstance(result, (list, tuple)) else type(result).__name__
        raise TypeError(f"op {task.spec.op!r} emitted {len(task.streamed)} items but returned "
                        f"{size}: a streaming op returns the list of what it emitted")


def summarize_completion(item: dict, bodies: dict[int, bytes] | None = None) -> dict:
    """A completion with its outputs described; a task whose output cannot be serialized fails
    (its outputs are not fetchable or movable) with an error that says so."""
    if not item["ok"]:
        return item
    key, trace_key = item.pop("report_key"), item.pop("trace_key")
    streamed = item.pop("streamed")
    if streamed:  # its items were described as they went (keys, traces): the list is their sum
        (object_id, _), = item["outputs"]
        item["outputs"] = [{"id": object_id, "count": len(streamed),
                            "nbytes": sum(part["nbytes"] for part in streamed)}]
        return item
    try:
        item["outputs"] = [summarize_output(i, v, key, trace_key, bodies)
                           for i, v in item["outputs"]]
    except SerializeError as exc:
        return {"task": item["task"], "ok": False, "start": item["start"], "end": item["end"],
                "error": f"its output cannot be sent: {exc}", "traceback": ""}
    return item


def summarize_output(object_id: int, value: Any, report_key: str | None = None,
             trace_key: str | None = None, bodies: dict[int, bytes] | None = None) -> dict:
    """What the controller learns of an output: its size, the value itself when tiny, and for
    a list (a Stream's items) its length and, if asked, each item's `report_key` field, so the
    controller can form groups without fetching the items, and each item's `trace_key` field
    (`trace`), which the controller's trace records [Note: traced items]. A small plain body
    is kept in `bodies` for the object's pushes (executors/outbox.py `packed`)."""
    if value is None:  # what most ops that only act return
        return {"id": object_id, "inline": _NONE_BODY}  # nbytes 0, the controller's default
    if isinstance(value, (bool, int, float)):
        return {"id": object_id, "nbytes": 0, "inline": pack(value)[0]}
    body, frames = packed(object_id, value, bodies)
    size = nbytes_of(frames) + len(body)
    out = {"id": object_id, "nbytes": size}
    if isinstance(value, (list, tuple)):
        out["count"] = len(value)
        if report_key is not None:
            out["keys"] = [_key_of(item, report_key) for item in value]
        if trace_key is not None:
            out["trace"] = [_trace_of(item, trace_key) for item in value]
    else:
        if report_key is not None:
            out["keys"] = [_key_of(value, report_key)]
        if trace_key is not None:
            out["trace"] = [_trace_of(value, trace_key)]
    if not frames and len(body) <= _INLINE_LIMIT:
        out["inline"] = body
    return out


def _key_of(item: Any, field: str) -> Any:
    key = item.get(field) if isinstance(item, dict) else getattr(item, field, None)
    return key if key is None or isinstance(key, (bool, int, float, str)) else str(key)


# [Note: traced items] A task spec's `trace_key` names a field (or property) of its output
# items; the executor reports its value for each item, in the completion or with each streamed
# part, and the controller appends them to the task's meta under "items", so the task's span in
# a trace shows them (Rollout.version_span: which weights versions sampled each response). They
# ride in every completion, so a traced field must be small plain data: anything else is sent
# as its text, a long list or text is cut to _TRACE_LIMIT.
_TRACE_LIMIT = 64


def _trace_of(item: Any, field: str) -> Any:
    return _plain(item.get(field) if isinstance(item, dict) else getattr(item, field, None))


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return value[:_TRACE_LIMIT]
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value[:_TRACE_LIMIT]]
    return _plain(str(value))


# [Note: merged tasks] Batched tasks of an op whose results do not depend on which items share
# a call (the inference ops' batch-invariant forwards, executors/torch/rollout/infer.py) run
# as one call when they wait together: the controller sends a scoring node's items as they
# finish, a few at a time, and each task paid its forwards' padded rows alone (the README's
# GRPO step: 208 rows scored for 128 rollouts; merged, its 55 reference tasks of 10 steps ran
# as 43 calls, `flowkit run examples/qwen2_grpo.py --steps 10 --trace t.json`). Only tasks of
# the same op, config, per-item ports and shared inputs, outside lanes, up to MERGED_ITEMS
# items; each is still answered alone, in its own order.
MERGED_ITEMS = 256


def merges_with(task: Task, other: Task) -> bool:
    """Whether `other` may run in one call with `task` [Note: merged tasks]."""
    a, b = task.spec, other.spec
    if b.op != a.op or b.items is None or b.lane is not None or b.stream or other.missing:
        return False
    if b.per_item != a.per_item or len(b.inputs) != len(a.inputs) or b.config != a.config:
        return False
    return all(x == y for j, (x, y) in enumerate(zip(a.inputs, b.inputs)) if j not in a.per_item)


def merged(tasks: list[Task], args: list[list]) -> tuple[Task, list]:
    """One task standing for `tasks` (each with its resolved `args`), and its arguments: the
    per-item inputs joined in order, the shared ones the first task's."""
    first = tasks[0].spec
    spec = attrs.evolve(first, items=sum(t.spec.items for t in tasks),
                        outputs=[i for t in tasks for i in t.spec.outputs])
    joined = [[v for a in args for v in a[j]] if j in first.per_item else args[0][j]
              for j in range(len(args[0]))]
    return Task(spec, tasks[0].fn), joined


def shares_of(tasks: list[Task], results: list) -> list[list]:
    """The merged call's flat outputs cut back into each task's."""
    cut, out = 0, []
    for task in tasks:
        count = len(task.spec.outputs)
        out.append(results[cut:cut + count])
        cut += count
    return out
