"""Whether a reply from an executor may count: it comes from the executor its task was sent to,
and a completion describes exactly that task's outputs not yet answered, well formed [Note: a
reply is checked before it counts]. The dispatcher (dispatch.py) asks before it changes anything
for the reply.

[Note: a reply is checked before it counts] Only the executor a task went to may answer for it
(DONE, PART, PARTS, STREAMS, ITEMS; a fetch's VALUE likewise), and a completion's outputs must be
the task's own: another object's future must never resolve through it. Tens of thousands of
completions a second come through here, so the usual one (one output, by id, with its value
inline or its size) is checked with a few type tests beside the lookups that counting makes
anyway; any other by the full check of flowkit/wire/protocol.py `check_completion`."""

from __future__ import annotations

from typing import Any

from flowkit.runtime.registry import ExecutorInfo, TaskRecord
from flowkit.wire.protocol import ProtocolError, check_completion

__all__ = ["check_sender", "completion_problem", "usual_completion"]


def check_sender(task: TaskRecord | None, executor: ExecutorInfo, kind: str) -> None:
    """ProtocolError if `task` exists and was sent to another executor than `executor`."""
    if task is not None and task.executor != executor.id:
        raise ProtocolError(f"{kind}: task {task.id} was not sent to {executor.describe()}; "
                            "ignored")


_TIMES = (float, int)
_USUAL_OUTPUT = frozenset({"id", "inline", "nbytes"})


def usual_completion(task: TaskRecord, item: dict, outputs: Any) -> bool:
    """Whether an ok completion is the usual kind and well formed: times, and the one output of
    a one-output task by its id, with its value inline or its size. Tens of thousands a
    second come through here, so these few type tests stand for check_completion's."""
    if type(item.get("start", 0.0)) not in _TIMES or type(item.get("end", 0.0)) not in _TIMES:
        return False
    if type(outputs) is not list or len(outputs) != 1 or len(task.outputs) != 1:
        return False
    out = outputs[0]
    return (type(out) is dict and type(out.get("id")) is int and out["id"] == task.outputs[0]
            and type(out.get("inline", b"")) is bytes and type(out.get("nbytes", 0)) is int
            and out.keys() <= _USUAL_OUTPUT and not task.answered)


def completion_problem(task: TaskRecord, item: dict) -> str:
    """What is wrong with a completion of `task` that is not the usual kind ('' if nothing):
    malformed, or not describing exactly the outputs of `task` not yet answered (a batched
    task's early items were [Note: early items in executors/process.py]): another object's
    future must never resolve through it."""
    try:
        check_completion(item)
    except ProtocolError as exc:
        return str(exc)
    if not item["ok"]:
        return ""
    outputs = item.get("outputs", ())
    expected = task.outputs[task.answered:] if task.answered else task.outputs
    if len(outputs) != len(expected) or any(
            out["id"] != object_id for out, object_id in zip(outputs, expected)):
        return f"the completion of task {task.id} names outputs that are not its own"
    return ""
