"""Futures of objects that executors produce.

A Future resolves when the completion message of the task that produces it reaches the controller;
the value itself stays on the executor until someone asks for it (`result()`), except for small
plain values, which ride along in the completion message. All futures of one controller share one
condition variable: the controller's IO thread resolves completions in batches and wakes waiters
once per batch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from flowkit.wire.serialize import unpack

__all__ = [
    "ALL_COMPLETED",
    "FIRST_COMPLETED",
    "ExecutorLost",
    "Future",
    "Owner",
    "RemoteError",
    "TaskCancelled",
    "wait",
]

ALL_COMPLETED, FIRST_COMPLETED = "ALL_COMPLETED", "FIRST_COMPLETED"
_PENDING, _DONE, _FAILED = 0, 1, 2
_NO_VALUE = object()


class RemoteError(RuntimeError):
    """An op raised on an executor; the message carries the remote traceback after MARK."""

    MARK = "\n--- remote traceback ---\n"

    def __init__(self, message: str, *, op: str = "", executor: str = "",
                 remote_traceback: str = "") -> None:
        self.op, self.executor, self.remote_traceback = op, executor, remote_traceback
        super().__init__(message)


class ExecutorLost(RemoteError):
    """The executor holding a task or an object died or stopped answering heartbeats."""


class TaskCancelled(RemoteError):
    """A task did not run because one of its inputs failed."""


class Owner(Protocol):
    """What a future needs of the controller that made it (flowkit/runtime/controller.py)."""

    condition: threading.Condition

    def release(self, object_id: int) -> None: ...
    def fetch(self, future: Future, timeout: float | None = None) -> Any: ...
    def wait_until(self, predicate: Callable[[], bool], timeout: float | None, *,
                   what: str = "waiting") -> None: ...


class Future:
    """The eventual output of a task: `result()`, `exception()`, `done()`, callbacks.

    [Note: object lifetime] The controller holds a future only while it is pending; after that
    the user's references decide. When the last one goes, `__del__` queues a release, and the
    object is freed on its executors once no pending task reads it either.
    """

    __slots__ = ("id", "_controller", "_state", "_value", "_body", "_error", "_callbacks",
                 "location", "nbytes", "count", "keys", "timing", "__weakref__")

    def __init__(self, object_id: int, controller: Owner) -> None:
        self.id = object_id
        self._controller = controller
        self._state = _PENDING
        self._value: Any = _NO_VALUE
        self._body: bytes | None = None  # a value that came inline, decoded when asked for
        self._error: BaseException | None = None
        self._callbacks: Sequence[Callable[[Future], Any]] = ()
        self.location: int | None = None  # executor id holding the value, once produced
        self.nbytes = 0
        self.count: int | None = None  # for a list value: its length (a Stream's item count)
        self.keys: list | None = None  # each item's field the task was asked to report
        self.timing: tuple[float, float] | None = None  # the producing op's (start, end), wall

    def __del__(self) -> None:
        self._controller.release(self.id)

    def __repr__(self) -> str:
        return f"<Future {self.id} {('pending', 'done', 'failed')[self._state]}>"

    def done(self) -> bool:
        return self._state != _PENDING

    def result(self, timeout: float | None = None) -> Any:
        """The value; fetched from the executor that holds it unless it came inline."""
        self._wait(timeout)
        if self._error is not None:
            raise self._error
        value = self._value
        if value is _NO_VALUE:
            body = self._body  # once: another thread may decode it meanwhile
            if body is None:
                value = self._value
                return value if value is not _NO_VALUE else self._controller.fetch(
                    self, timeout=timeout)
            value = self._value = unpack(body, [])
            self._body = None
        return value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        return self._error

    def add_done_callback(self, fn: Callable[[Future], Any]) -> None:
        """Call `fn(future)` once it is done: now if it already is, else on the controller's IO
        thread (so keep it short and never block in it)."""
        with self._controller.condition:
            if self._state == _PENDING:
                self._callbacks = [*self._callbacks, fn]
                return
        fn(self)

    def _wait(self, timeout: float | None) -> None:
        if self._state == _PENDING:
            self._controller.wait_until(self.done, timeout, what=f"waiting for {self!r}")

    # -- called by the controller's IO thread, holding the condition -------------------------
    def _resolve(self, location: int | None, nbytes: int, value: Any = _NO_VALUE,
                 body: bytes | None = None) -> Sequence:
        """Done: the value is on executor `location`, and here too when given (`value`, or its
        packed `body`: the controller decodes no item it is not asked for)."""
        self.location, self.nbytes, self._value, self._body = location, nbytes, value, body
        self._state = _DONE
        return self._take_callbacks()

    def _fail(self, error: BaseException) -> Sequence:
        if self._state != _PENDING:
            return ()
        self._error = error
        self._state = _FAILED
        return self._take_callbacks()

    def _take_callbacks(self) -> Sequence:
        """(fn, future) pairs to run; none can be added once the future is done."""
        callbacks, self._callbacks = self._callbacks, ()
        return [(fn, self) for fn in callbacks] if callbacks else ()


def wait(futures: Iterable[Future], timeout: float | None = None,
         return_when: str = ALL_COMPLETED) -> tuple[set[Future], set[Future]]:
    """(done, not_done) once all (or the first, with FIRST_COMPLETED) are done, or at timeout."""
    futures = set(futures)
    if not futures:
        return set(), set()
    controller = next(iter(futures))._controller
    pending = [f for f in futures if not f.done()]

    def finished() -> bool:
        if return_when == FIRST_COMPLETED:
            return len(pending) < len(futures) or any(f.done() for f in pending)
        # called after every batch of completions: never look at a finished future twice
        while pending and pending[-1].done():
            pending.pop()
        return not pending

    try:
        controller.wait_until(finished, timeout, what="wait()")
    except TimeoutError:
        pass
    done = {f for f in futures if f.done()}
    return done, futures - done


def new_condition() -> threading.Condition:
    return threading.Condition(threading.Lock())
