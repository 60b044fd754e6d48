"""Synthetic controller events, built from the runtime's own records, for observer tests."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from flowkit.runtime.futures import RemoteError, TaskCancelled
from flowkit.runtime.registry import ExecutorInfo, TaskRecord

T0 = 1_700_000_000.0  # a wall-clock origin, so spans look like real time.time() values

_task_ids = itertools.count(1)

Listener = Callable[[str, dict], object]


def executor(executor_id: int, name: str | None = None, tags: tuple[str, ...] = ()) -> ExecutorInfo:
    return ExecutorInfo(id=executor_id, name=name or f"exec-{executor_id}", tags=tags,
                        ops=frozenset({"F", "B", "W", "sleep"}), pid=1000 + executor_id,
                        host="localhost", device="cpu", peer_address="", identity=b"x")


def task(op: str, on: ExecutorInfo, start: float = 0.0, end: float = 0.0, *,
         meta: dict | None = None, nbytes: int = 0) -> TaskRecord:
    """A task that ran from T0 + start to T0 + end (seconds); start = end = 0: never ran."""
    ran = end > 0.0
    return TaskRecord(id=next(_task_ids), op=op, executor=on.id, inputs=[], outputs=[],
                      config={}, meta=meta or {}, start=T0 + start if ran else 0.0,
                      end=T0 + end if ran else 0.0, nbytes_out=nbytes)


def join(listener: Listener, *executors: ExecutorInfo) -> None:
    for info in executors:
        listener("executor_joined", {"executor": info})


def run(listener: Listener, record: TaskRecord, on: ExecutorInfo) -> TaskRecord:
    """Submit and finish `record` on `on`, as the dispatcher reports it."""
    listener("task_submitted", {"task": record, "executor": on})
    listener("task_done", {"task": record, "executor": on})
    return record


def fail(listener: Listener, record: TaskRecord, on: ExecutorInfo,
         message: str = "boom") -> TaskRecord:
    listener("task_submitted", {"task": record, "executor": on})
    error = RemoteError(f"op {record.op!r} failed on {on.describe()}: {message}\n"
                        "--- remote traceback ---\nTraceback ...", op=record.op)
    listener("task_failed", {"task": record, "error": error})
    return record


def cancel(listener: Listener, record: TaskRecord) -> TaskRecord:
    """A task failed without running because its input failed (never submitted)."""
    listener("task_failed", {"task": record, "error": TaskCancelled("input failed",
                                                                    op=record.op)})
    return record


def schedule(listener: Listener, devices: list[ExecutorInfo],
             rows: list[list[tuple[str, float, float]]], *, step: int | None = None) -> None:
    """Run pipeline ops given per device as ("0F1", start, end) action texts."""
    for device, ops in zip(devices, rows):
        for text, start, end in ops:
            stage, kind, microbatch = _parse(text)
            meta = {"stage": stage, "microbatch": microbatch}
            if step is not None:
                meta["step"] = step
            run(listener, task(kind, device, start, end, meta=meta), device)


def _parse(text: str) -> tuple[int, str, int]:
    from flowkit.planner.ir import Action

    action = Action.parse(text)
    return action.stage, action.kind.value, action.microbatch
