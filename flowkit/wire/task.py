"""One task, as the controller sends it and an executor runs it: a TaskSpec, encoded once (by
the controller, into a RUN message) and decoded once (by protocol.decode, on the executor),
which checks every field on the way in.

[Note: a task on the wire] A RUN message's `tasks` is a list of maps,

    id, op, config, inputs (wire refs: refs.py), outputs (object ids)   always
    lane, report_key, trace_key, stream                                  only when set
    items, per_item                                                      a batched task

[Note: batched tasks] A per-item op on many ready items goes as one task: `items` is how many,
`per_item` the positions of the inputs that hold one ref per item (each a gather of `items`
refs); the other inputs are the same for every item (a barrier's gather, weights). Its outputs
are the items' outputs in order, `len(outputs) // items` each. The executor runs the op on
each item (or once on the lists, for an op with a batched form: executors/optable.py) and
answers with one completion for them all.

A body that is no map, or whose id, op, config, inputs or outputs are missing or of the wrong
type, makes the whole message malformed (an ERROR reply: without them the task cannot even be
named). Anything else wrong (an input ref, a lane, a key, the stream flag, an output id)
rejects that task alone: the executor fails it, saying why, and runs the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from flowkit.wire.refs import check_ref
from flowkit.wire.schema import ProtocolError, Schema, check_fields

__all__ = ["MAX_WINDOW", "MalformedTask", "RejectedTask", "TaskSpec", "decode_tasks"]

# the fields without which a task cannot be named, nor so failed: their errors fail the message
_NAMING_SCHEMA: Schema = {"id": int, "op": str, "config": dict, "inputs": list, "outputs": list}
MAX_ITEMS = 65536  # items in one batched task: more is a message no sane controller sends
MAX_WINDOW = 1 << 20  # items a streaming task may run ahead of its credits (MAX_PARTS)


class MalformedTask(ProtocolError):
    """A task that can be named (its id) but not run: it fails alone."""

    def __init__(self, task_id: int, reason: str) -> None:
        super().__init__(reason)
        self.task_id = task_id


@attrs.frozen
class RejectedTask:
    """In a decoded RUN message, the place of a task that failed its checks (MalformedTask)."""

    id: int
    reason: str


@attrs.frozen
class TaskSpec:
    """What to run: `op` with `config` on `inputs` (wire refs), writing `outputs` (object ids);
    `lane`: tasks of one lane run in the order they arrived [Note: lanes in
    executors/tasks.py]; `report_key` and `trace_key`: fields of the output items the executor
    reports [Note: traced items in executors/tasks.py]; `stream`: send each item the op yields
    as it comes [Note: streaming ops in executors/optable.py], and with `window` at most that
    many items ahead of the items the controller credited back [Note: stream credits in
    flowkit/runtime/credits.py]; `items` and `per_item`: a batched task, one call per item
    [Note: batched tasks].

    The controller builds one with op, config and options, and encodes it with the task's id,
    input refs and output ids once it knows them (`encode_as`). No validators: the executor
    checks the task it decodes (`decode`), and answers a malformed one with a failure that
    says why."""

    op: str
    config: dict[str, Any]
    inputs: Sequence[Any] = ()
    outputs: Sequence[int] = ()
    id: int = 0  # 0 until numbered: the controller's ids count up from 1
    lane: str | None = None
    report_key: str | None = None
    trace_key: str | None = None
    stream: bool = False
    items: int | None = None
    per_item: tuple[int, ...] = ()
    window: int | None = None

    def encode(self) -> dict[str, Any]:
        """The task's body in a RUN message [Note: a task on the wire]."""
        return self.encode_as(self.id, self.inputs, self.outputs)

    def encode_as(self, task_id: int, inputs: Sequence[Any],
                  outputs: Sequence[int]) -> dict[str, Any]:
        """The body of this task given its id, input refs and output ids: the controller's,
        which learns them as it places the task (one record a task fewer than numbering a copy
        and encoding that: a microsecond of the dispatch path's ten)."""
        body = {"id": task_id, "op": self.op, "config": self.config, "inputs": inputs,
                "outputs": outputs}
        if self.lane is not None:
            body["lane"] = self.lane
        if self.report_key is not None:
            body["report_key"] = self.report_key
        if self.trace_key is not None:
            body["trace_key"] = self.trace_key
        if self.stream:
            body["stream"] = True
            if self.window is not None:
                body["window"] = self.window
        if self.items is not None:
            body["items"], body["per_item"] = self.items, list(self.per_item)
        return body

    @classmethod
    def decode(cls, body: Any) -> TaskSpec:
        """The task a RUN message's body describes; a ProtocolError naming the field that is
        wrong, a MalformedTask (one) when the task itself can still be named."""
        if type(body) is not dict:
            raise ProtocolError(f"run: a task must be a map, got {type(body).__name__}")
        check_fields("run task", body, _NAMING_SCHEMA)
        task_id = body["id"]
        if task_id < 0:
            raise ProtocolError(f"run task: field 'id' must be a non-negative int, got {task_id}")
        try:
            inputs, outputs = _inputs(body["inputs"]), _outputs(body["outputs"])
            if len(body) == len(_NAMING_SCHEMA):  # no options: the usual task, checked
                return cls(body["op"], body["config"], inputs, outputs, task_id)
            stream = _stream(body.get("stream", False), outputs)
            items, per_item = _batch(body, inputs, outputs, stream)
            return cls(body["op"], body["config"], inputs, outputs, task_id,
                       _lane(body.get("lane")), _field_name(body, "report_key"),
                       _field_name(body, "trace_key"), stream, items, per_item,
                       _window(body.get("window"), stream))
        except ProtocolError as exc:
            raise MalformedTask(task_id, str(exc)) from None


def decode_tasks(bodies: list) -> list[TaskSpec | RejectedTask]:
    """A RUN message's tasks: each a TaskSpec, or a RejectedTask where it is malformed; a
    ProtocolError when one cannot even be named [Note: a task on the wire]."""
    tasks: list[TaskSpec | RejectedTask] = []
    for body in bodies:
        try:
            tasks.append(TaskSpec.decode(body))
        except MalformedTask as exc:
            tasks.append(RejectedTask(exc.task_id, str(exc)))
    return tasks


def _inputs(refs: list) -> list:
    for ref in refs:
        if type(ref) is not int:  # the usual task reads whole objects: one test each
            check_ref(ref)
    return refs


def _outputs(ids: list) -> list:
    for object_id in ids:
        if type(object_id) is not int or object_id < 0:
            raise ProtocolError(f"outputs must be object ids, got {object_id!r:.80}")
    return ids


def _window(window: Any, stream: bool) -> int | None:
    if window is None:
        return None
    if type(window) is not int or not stream or not 1 <= window <= MAX_WINDOW:
        raise ProtocolError(f"window must be an int of 1 to {MAX_WINDOW}, for a streaming task; "
                            f"got {window!r:.80}")
    return window


def _stream(stream: Any, outputs: list) -> bool:
    if type(stream) is not bool or stream and len(outputs) != 1:
        raise ProtocolError(f"stream must be true or false, for a task of one output; got "
                            f"{stream!r:.80} for {len(outputs)} outputs")
    return stream


def _batch(body: dict, inputs: list, outputs: list,
           stream: bool) -> tuple[int | None, tuple[int, ...]]:
    """(items, per_item) of a batched task [Note: batched tasks], (None, ()) for another."""
    items, per_item = body.get("items"), body.get("per_item")
    if items is None and per_item is None:
        return None, ()
    if type(items) is not int or not 1 <= items <= MAX_ITEMS:
        raise ProtocolError(f"items must be an int in 1..{MAX_ITEMS}, got {items!r:.80}")
    if stream or len(outputs) % items:
        raise ProtocolError(f"items: a batched task of {items} items does not stream and has "
                            f"a multiple of {items} outputs, got {len(outputs)}")
    if type(per_item) is not list or not per_item or len(set(per_item)) != len(per_item) or any(
            type(j) is not int or not 0 <= j < len(inputs) for j in per_item):
        raise ProtocolError(f"per_item must list distinct input positions (at least one), got "
                            f"{per_item!r:.80}")
    for j in per_item:
        ref = inputs[j]
        if type(ref) is not dict or len(ref["gather"]) != items:
            raise ProtocolError(f"per_item input {j} must gather one ref per item ({items})")
    return items, tuple(per_item)


def _lane(lane: Any) -> str | None:
    if lane is not None and type(lane) is not str:
        raise ProtocolError(f"a task's lane must be a string, got {lane!r:.80}")
    return lane


def _field_name(body: dict, key: str) -> str | None:
    name = body.get(key)
    if name is not None and type(name) is not str:
        raise ProtocolError(f"{key} must be a field name, got {name!r:.80}")
    return name
