"""Trace recording, and export to the Chrome trace event format that Perfetto and
chrome://tracing open.

`TraceRecorder` is a controller listener: it runs on the controller's IO thread, so it only copies
what a finished task tells it into a list; the JSON is built when asked for.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from flowkit.observe.spans import ExecutorLabel, Span, bubble_rate, jsonable
from flowkit.runtime.registry import ExecutorInfo

__all__ = ["ExecutorLoss", "TraceRecorder", "chrome_trace"]

_FAILED_COLOR = "terrible"  # a reserved trace-viewer color name: failed ops stand out in red
_OPS_THREAD = 0  # each executor runs its ops on one compute thread: one row per executor


@attrs.frozen
class ExecutorLoss:
    executor: ExecutorLabel
    reason: str
    seen: float  # controller wall clock, time.time()


class TraceRecorder:
    """Records every finished task for a trace: `ctl.add_listener(TraceRecorder())`, or
    `TraceRecorder().attach(ctl)`, which also learns the executors that are already connected.

    `max_spans` bounds memory on long runs by keeping only the latest spans (`dropped` counts the
    rest); None keeps all.
    """

    def __init__(self, *, max_spans: int | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._spans: deque[Span] = deque(maxlen=max_spans)
        self._executors: dict[int, ExecutorLabel] = {}
        self._losses: list[ExecutorLoss] = []
        self._lock = threading.Lock()  # held for an append or a copy, never longer
        self._clock = clock
        self.dropped = 0

    def attach(self, controller: Any) -> TraceRecorder:
        for info in controller.executors():
            self._learn(info)
        controller.add_listener(self)
        return self

    # -- the listener (controller IO thread) ---------------------------------------------------
    def __call__(self, event: str, payload: dict) -> None:
        if event == "task_done":
            self._record(Span.of(payload["task"], self._learn(payload["executor"])))
        elif event == "task_failed":
            task = payload["task"]
            self._record(Span.of(task, self._label(task.executor), error=payload["error"],
                                 seen=self._clock()))
        elif event == "executor_joined":
            self._learn(payload["executor"])
        elif event == "executor_lost":
            loss = ExecutorLoss(self._learn(payload["executor"]), str(payload["reason"]),
                                self._clock())
            with self._lock:
                self._losses.append(loss)

    def _record(self, span: Span) -> None:
        with self._lock:
            if len(self._spans) == self._spans.maxlen:
                self.dropped += 1
            self._spans.append(span)

    def _learn(self, info: ExecutorInfo | ExecutorLabel) -> ExecutorLabel:
        label = self._executors.get(info.id)
        # an executor first seen by id alone (a failed task) gets its name when it shows up
        if label is None or (label.name != info.name and not isinstance(info, ExecutorLabel)):
            label = info if isinstance(info, ExecutorLabel) else ExecutorLabel.of(info)
            with self._lock:
                self._executors[info.id] = label
        return label

    def _label(self, executor_id: int) -> ExecutorLabel:
        label = self._executors.get(executor_id)
        return label if label is not None else self._learn(ExecutorLabel.unknown(executor_id))

    # -- reading (any thread) ------------------------------------------------------------------
    @property
    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    @property
    def losses(self) -> list[ExecutorLoss]:
        with self._lock:
            return list(self._losses)

    @property
    def executors(self) -> list[ExecutorLabel]:
        with self._lock:
            return sorted(self._executors.values(), key=lambda e: e.id)

    def bubble_rate(self) -> float | None:
        """The measured bubble rate of the recorded pipeline ops (see `BubbleMeter`)."""
        return bubble_rate(self.spans)

    def to_chrome(self, *, display_time_unit: str = "ms") -> dict:
        """The trace as a Chrome trace event object ({"traceEvents": [...], ...})."""
        with self._lock:
            spans, losses = list(self._spans), list(self._losses)
            executors = sorted(self._executors.values(), key=lambda e: e.id)
        return chrome_trace(spans, losses, executors, display_time_unit=display_time_unit,
                            dropped=self.dropped)

    def write_chrome(self, path: str | Path, *, display_time_unit: str = "ms") -> Path:
        """Write the trace as JSON (open it in https://ui.perfetto.dev); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        trace = self.to_chrome(display_time_unit=display_time_unit)
        path.write_text(json.dumps(trace, separators=(",", ":")))
        return path


def chrome_trace(spans: list[Span], losses: list[ExecutorLoss], executors: list[ExecutorLabel],
                 *, display_time_unit: str = "ms", dropped: int = 0) -> dict:
    """Chrome trace event format: one process per executor (pid = executor id), one complete
    event ("X") per op that ran, an instant event ("i") per task failed without running and per
    lost executor. Times are microseconds from the earliest event."""
    origin = _origin(spans, losses)
    events = [*_executor_metadata(executors)]
    for span in spans:
        events.append(_span_event(span, origin))
    for loss in losses:
        events.append(_loss_event(loss, origin))
    rate = bubble_rate(spans)
    return {
        "traceEvents": events,
        "displayTimeUnit": display_time_unit,
        "otherData": {"producer": "flowkit", "origin_unix_s": origin, "dropped_spans": dropped,
                      "bubble_rate": rate},
    }


def _origin(spans: list[Span], losses: list[ExecutorLoss]) -> float:
    times = [s.start if s.ran else s.seen for s in spans] + [loss.seen for loss in losses]
    times = [t for t in times if t > 0.0]
    return min(times, default=0.0)


def _us(seconds: float) -> float:
    # Sub-microsecond digits are noise on a wall clock; rounding keeps the file small.
    return round(max(0.0, seconds) * 1e6, 3)


def _executor_metadata(executors: list[ExecutorLabel]) -> list[dict]:
    events = []
    for label in executors:
        tags = ",".join(label.tags)
        name = f"{label.name} [{tags}]" if tags else label.name
        common = {"ph": "M", "pid": label.id, "tid": _OPS_THREAD}
        where = " ".join(part for part in (label.device, label.host) if part)
        events += [
            {**common, "name": "process_name", "args": {"name": name}},
            {**common, "name": "process_sort_index", "args": {"sort_index": label.id}},
            {**common, "name": "thread_name", "args": {"name": f"{label.name} ops"}},
        ]
        if where:
            events.append({**common, "name": "process_labels", "args": {"labels": where}})
    return events


def _span_event(span: Span, origin: float) -> dict:
    # meta is made JSON-safe here, not when recorded: export is rare, recording is per task
    args: dict[str, Any] = {**jsonable(span.meta), "task": span.task, "bytes": span.nbytes}
    event: dict[str, Any] = {"name": span.label, "cat": span.op, "pid": span.executor.id,
                             "tid": _OPS_THREAD, "args": args}
    if not span.ok:
        args["error"] = span.error
        event["cname"] = _FAILED_COLOR
    if span.ran:
        event.update(ph="X", ts=_us(span.start - origin), dur=_us(span.duration))
    else:
        # never ran: mark the moment the controller gave up on it
        event.update(ph="i", s="t", ts=_us(span.seen - origin))
        event["name"] = f"{span.label} (not run)"
    return event


def _loss_event(loss: ExecutorLoss, origin: float) -> dict:
    return {"name": f"{loss.executor.name} lost", "cat": "executor_lost", "ph": "i", "s": "p",
            "pid": loss.executor.id, "tid": _OPS_THREAD, "ts": _us(loss.seen - origin),
            "cname": _FAILED_COLOR, "args": {"reason": loss.reason}}
