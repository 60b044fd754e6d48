"""Credit-based flow control of streaming tasks: the controller's side.

[Note: stream credits] A streaming task with a window (`Controller.submit(..., window=K)`)
runs at most K items ahead of the items its consumers are done with, so a slow consumer holds a
fast producer back instead of letting its items queue without end (on the consumer's executor,
in its memory). An item is credited back once its `on_part` has run (or, for a caller that
reacts later, once the caller says it `handled` the item) and no task reading it on another
executor is pending: the consumers submitted for it by then have finished. An item nobody
consumes yet (a group that waits for its other samples) is credited at once: it waits on its
producer, whose output it is anyway, so it cannot deadlock a stream whose consumers need several
items; neither can a consumer on the producer's own executor, which could not run while the
producer waits. The controller sends CREDIT with the count credited so far; the executor's op
waits in `emit` while it is K ahead (executors/process.py `_wait_for_credit`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from flowkit.runtime.registry import ExecutorInfo, ObjectRecord, TaskRecord
from flowkit.wire.protocol import Msg

__all__ = ["StreamCredits"]


class StreamCredits:
    """The credits of the controller's windowed streams; its Dispatcher's books, which it
    reads and never changes, and its IO lock."""

    def __init__(self, tasks: dict[int, TaskRecord], objects: dict[int, ObjectRecord],
                 executors: dict[int, ExecutorInfo],
                 send: Callable[[ExecutorInfo, str, dict], None]) -> None:
        self._tasks, self._objects, self._executors, self._send = tasks, objects, executors, send
        self.checks: deque = deque()  # (task, item record) whose on_part has run
        self.handled: deque = deque()  # ids of items a caller handled (any thread appends)
        self._due: dict[int, TaskRecord] = {}  # tasks whose credit grew since the last send

    @property
    def due(self) -> bool:
        return bool(self._due)

    def check(self) -> None:
        """Credit the items whose on_part has run (or that the caller handled), unless
        consumers elsewhere still read them."""
        checks, handled = self.checks, self.handled
        while handled:
            record = self._objects.get(handled.popleft())
            task = None if record is None else self._tasks.get(record.producer)
            if task is not None:
                checks.append((task, record))
        while checks:
            task, record = checks.popleft()
            if task.state != "pending":
                continue
            if self._read_elsewhere(record, task.executor):
                record.credit_of = task.id  # credited when they end (`consumed`)
            else:
                self._credit(task)

    def consumed(self, record: ObjectRecord) -> None:
        """A task reading `record`, an item that waits for its consumers, has ended."""
        producer = self._tasks.get(record.credit_of)
        if producer is None or producer.state != "pending":
            record.credit_of = 0
        elif not self._read_elsewhere(record, producer.executor):
            record.credit_of = 0
            self._credit(producer)

    def send(self) -> None:
        """One CREDIT a task whose credit grew: the count so far, so none is lost or doubled."""
        for task in self._due.values():
            executor = self._executors[task.executor]
            if task.state == "pending" and executor.alive:
                self._send(executor, Msg.CREDIT, {"task": task.id, "credited": task.credited})
        self._due.clear()

    def _read_elsewhere(self, record: ObjectRecord, executor_id: int) -> bool:
        tasks = self._tasks
        return any(t is not None and t.state == "pending" and t.executor != executor_id
                   for t in map(tasks.get, record.consumers))

    def _credit(self, task: TaskRecord) -> None:
        task.credited += 1
        self._due[task.id] = task
