"""Run-wide figures from task events (`RunStats`), and a JSON-lines writer for metrics.

`RunStats` is a controller listener and runs on the controller's IO thread: it keeps counters
only (no per-task list), so its cost and memory stay flat however long the run. Readers take a
`StatsSnapshot`, an immutable copy, and never look at the live counters.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import attrs

from flowkit.observe.spans import BubbleMeter, ExecutorLabel, error_line, jsonable
from flowkit.runtime.futures import ExecutorLost, TaskCancelled
from flowkit.runtime.registry import ExecutorInfo, TaskRecord

__all__ = ["UTILIZATION_WINDOW_S", "ExecutorStats", "MetricsWriter", "RunStats", "StatsSnapshot"]

# What the dashboard's utilization is over: long enough to smooth over a step's ops, short
# enough that an executor gone idle reads 0 % within seconds, not its average since the start.
UTILIZATION_WINDOW_S = 10.0

# The dispatcher words a remote failure "op 'F' failed on exec-0 (id 1, pid ..., tags ...): why";
# the dashboard already names the op and executor, so only "why" is kept.
_REMOTE_PREFIX = re.compile(r"^op '[^']*' failed on [^:]*: ")


class MetricsWriter:
    """Writes one JSON object per line to `path`, each with a wall-clock `time` (unix seconds;
    a record's own `time` wins), flushed at once so a crashed run keeps every line written.

    `with MetricsWriter("run/metrics.jsonl") as metrics: metrics.write({"step": 1, **stats})`.
    """

    def __init__(self, path: str | Path, *, append: bool = False,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("a" if append else "w", encoding="utf-8")
        self._lock = threading.Lock()  # a runner may write from several threads
        self._clock = clock

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps({"time": self._clock(), **jsonable(record)}, allow_nan=False)
        with self._lock:
            if self._file is None:
                raise ValueError(f"metrics file {self.path} is closed")
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@attrs.frozen(kw_only=True)
class ExecutorStats:
    """One executor, as of a snapshot."""

    label: ExecutorLabel
    alive: bool
    lost_reason: str
    current_op: str | None  # op of its oldest outstanding task: executors run tasks in order
    queued: int  # tasks sent to it and not finished
    completed: int
    failed: int
    busy_s: float
    utilization: float  # busy time / wall time since the run started: the metrics file's
    # time in ops that finished within the last UTILIZATION_WINDOW_S: the dashboard's (an op
    # still running counts once it finishes; queued work may be waiting on its inputs)
    recent_utilization: float
    bytes_out: int


@attrs.frozen(kw_only=True)
class StatsSnapshot:
    """Run-wide figures at one moment; what dashboards render and metrics record."""

    elapsed_s: float
    done: int
    failed: int
    errors: int  # root causes: failed ops and lost executors, not the tasks cancelled after them
    ops_per_s: float
    bytes_out: int
    bubble_rate: float | None  # None until a pipeline op (meta stage + microbatch) has run
    last_error: str
    executors: tuple[ExecutorStats, ...]
    timing_s: dict[str, float]  # summed op time per op name

    def summary(self) -> dict[str, Any]:
        """A flat dict for `MetricsWriter`, keys named like verl's (`timing_s/<op>`)."""
        record: dict[str, Any] = {
            "tasks/done": self.done, "tasks/failed": self.failed, "tasks/errors": self.errors,
            "perf/elapsed_s": round(self.elapsed_s, 6), "perf/ops_per_s": self.ops_per_s,
            "perf/bytes_out": self.bytes_out, "perf/bubble_rate": self.bubble_rate,
        }
        for executor in self.executors:
            record[f"perf/utilization/{executor.label.name}"] = round(executor.utilization, 6)
        for op, seconds in sorted(self.timing_s.items()):
            record[f"timing_s/{op}"] = round(seconds, 6)
        return record


@attrs.define
class _ExecutorCounters:
    label: ExecutorLabel
    alive: bool = True
    lost_reason: str = ""
    # task id -> the task, in submit order: labelled only when a snapshot shows the oldest
    outstanding: dict[int, TaskRecord] = attrs.field(factory=dict)
    completed: int = 0
    failed: int = 0
    busy_s: float = 0.0
    bytes_out: int = 0
    # (start, end) of the ops that finished lately: enough to cover UTILIZATION_WINDOW_S
    recent: deque[tuple[float, float]] = attrs.field(factory=deque)


class RunStats:
    """Counts what the controller reports: `RunStats().attach(ctl)` (or `ctl.add_listener`).

    The run starts at the first task event; utilization and ops per second are over the time
    since then, so a stats object made long before the first submit is not diluted.
    """

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()  # the IO thread updates, readers snapshot; both are quick
        self._executors: dict[int, _ExecutorCounters] = {}
        self._timing: dict[str, float] = {}
        self._bubble = BubbleMeter()
        self.started: float | None = None
        self._done = self._failed = self._errors = self._bytes = 0
        self._last_error = ""

    def attach(self, controller: Any) -> RunStats:
        for info in controller.executors():
            self("executor_joined", {"executor": info})
        controller.add_listener(self)
        return self

    # -- the listener (controller IO thread) ---------------------------------------------------
    def __call__(self, event: str, payload: dict) -> None:
        with self._lock:
            if event == "task_submitted":
                self._on_submitted(payload["task"])
            elif event == "task_done":
                self._on_done(payload["task"], payload["executor"])
            elif event == "task_failed":
                self._on_failed(payload["task"], payload["error"])
            elif event == "executor_joined":
                self._counters(payload["executor"])
            elif event == "executor_lost":
                self._on_lost(payload["executor"], payload["reason"])

    def _counters(self, info: ExecutorInfo | int) -> _ExecutorCounters:
        if isinstance(info, int):
            counters = self._executors.get(info)
            if counters is None:
                counters = self._executors[info] = _ExecutorCounters(ExecutorLabel.unknown(info))
            return counters
        counters = self._executors.get(info.id)
        if counters is None:
            counters = self._executors[info.id] = _ExecutorCounters(ExecutorLabel.of(info))
        elif counters.label.name != info.name:  # first seen by id alone: now we know its name
            counters.label = ExecutorLabel.of(info)
        return counters

    def _start(self, at: float) -> None:
        if at > 0.0 and (self.started is None or at < self.started):
            self.started = at

    def _on_submitted(self, task: TaskRecord) -> None:
        self._start(self._clock())
        self._counters(task.executor).outstanding[task.id] = task

    def _on_done(self, task: TaskRecord, info: ExecutorInfo) -> None:
        counters = self._counters(info)
        counters.outstanding.pop(task.id, None)
        duration = max(0.0, task.end - task.start)
        self._start(task.start)
        counters.completed += 1
        counters.busy_s += duration
        _remember(counters.recent, task.start, task.end, self._clock())
        counters.bytes_out += task.nbytes_out
        self._done += 1
        self._bytes += task.nbytes_out
        self._timing[task.op] = self._timing.get(task.op, 0.0) + duration
        self._bubble.add_op(counters.label.id, task.start, task.end, task.meta)

    def _on_failed(self, task: TaskRecord, error: BaseException) -> None:
        counters = self._counters(task.executor)
        counters.outstanding.pop(task.id, None)
        counters.failed += 1
        self._failed += 1
        # A cancelled task repeats its input's error and a task lost with its executor repeats
        # the loss: count and show only the root cause.
        if not isinstance(error, TaskCancelled | ExecutorLost):
            self._errors += 1
            message = _REMOTE_PREFIX.sub("", error_line(error), count=1)
            self._last_error = f"{task.op} on {counters.label.name}: {message}"

    def _on_lost(self, info: ExecutorInfo, reason: str) -> None:
        counters = self._counters(info)
        counters.alive, counters.lost_reason = False, str(reason)
        self._errors += 1
        self._last_error = f"{counters.label.name} lost: {error_line(reason)}"

    # -- reading (any thread) ------------------------------------------------------------------
    def step_line(self, report: Any) -> dict:
        """A step's metrics line from its StepReport (flowkit/runner/flowrun.py): its metrics
        and timings, tokens/s, the first loss as `loss`, and the run's ops/s so far."""
        line = {"step": report.step, "step_s": report.elapsed_s, **report.metrics}
        line.update({f"timing_s/{name}": seconds for name, seconds in report.timing_s.items()})
        tokens = sum(v for k, v in report.metrics.items() if k.endswith("/tokens"))
        if tokens:
            line["tokens_per_s"] = tokens / report.elapsed_s
        losses = [v for k, v in report.metrics.items() if k.endswith("/loss")]
        if losses:
            line["loss"] = losses[0]
        line["perf/ops_per_s"] = self.snapshot().summary().get("perf/ops_per_s")
        return line

    def snapshot(self) -> StatsSnapshot:
        now = self._clock()
        with self._lock:
            elapsed = 0.0 if self.started is None else max(0.0, now - self.started)
            executors = tuple(_executor_stats(c, elapsed, now)
                              for _, c in sorted(self._executors.items()))
            return StatsSnapshot(
                elapsed_s=elapsed, done=self._done, failed=self._failed, errors=self._errors,
                ops_per_s=self._done / elapsed if elapsed > 0 else 0.0,
                bytes_out=self._bytes, bubble_rate=self._bubble.rate(),
                last_error=self._last_error, executors=executors, timing_s=dict(self._timing))

    def summary(self) -> dict[str, Any]:
        """`snapshot().summary()`: the flat metrics record of the run so far."""
        return self.snapshot().summary()


def _op_label(task: TaskRecord) -> str:
    """What the dashboard shows an executor running: the op, and the flow step it is for when
    the runner says (in an asynchronous run, generation works on later steps than training)."""
    step = task.meta.get("step") if isinstance(task.meta, dict) else None
    return task.op if step is None else f"{task.op} · step {step}"


def _remember(recent: deque, start: float, end: float, now: float) -> None:
    if end > start:
        recent.append((start, end))
    while recent and recent[0][1] < now - 2 * UTILIZATION_WINDOW_S:  # clocks may differ a little
        recent.popleft()


def _recent_utilization(recent: deque, elapsed: float, now: float) -> float:
    window = min(UTILIZATION_WINDOW_S, elapsed)
    if window <= 0.0:
        return 0.0
    since = now - window
    busy = sum(max(0.0, min(end, now) - max(start, since)) for start, end in recent)
    return min(1.0, busy / window)


def _executor_stats(counters: _ExecutorCounters, elapsed: float, now: float) -> ExecutorStats:
    oldest = next(iter(counters.outstanding.values()), None)
    current = None if oldest is None else _op_label(oldest)
    # Executor clocks can run a little ahead of the controller's: never show more than 100 %.
    utilization = min(1.0, counters.busy_s / elapsed) if elapsed > 0 else 0.0
    return ExecutorStats(
        label=counters.label, alive=counters.alive, lost_reason=counters.lost_reason,
        current_op=current, queued=len(counters.outstanding), completed=counters.completed,
        failed=counters.failed, busy_s=counters.busy_s, utilization=utilization,
        recent_utilization=_recent_utilization(counters.recent, elapsed, now),
        bytes_out=counters.bytes_out)
