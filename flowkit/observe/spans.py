"""What observers keep of a finished task (a `Span`) and of an executor, and the bubble meter.

Spans are built from the controller's records on its IO thread, so they copy the few fields they
need: a `TaskRecord` is owned by that thread and an `ExecutorInfo` keeps changing.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

import attrs

from flowkit import planner
from flowkit.runtime.registry import ExecutorInfo, TaskRecord

__all__ = [
    "BubbleMeter",
    "ExecutorLabel",
    "Span",
    "bubble_rate",
    "error_line",
    "is_pipeline",
    "jsonable",
]


@attrs.frozen
class ExecutorLabel:
    """Who an executor is, as a trace or dashboard names it."""

    id: int
    name: str
    tags: tuple[str, ...] = ()
    host: str = ""
    device: str = ""

    @classmethod
    def of(cls, info: ExecutorInfo) -> ExecutorLabel:
        return cls(id=info.id, name=info.name, tags=tuple(info.tags), host=info.host,
                   device=info.device)

    @classmethod
    def unknown(cls, executor_id: int) -> ExecutorLabel:
        """For an executor that joined before the observer was attached and was never seen."""
        return cls(id=executor_id, name=f"executor-{executor_id}")


@attrs.frozen
class Span:
    """One finished task: when it ran (executor wall clock, `time.time()` seconds) and how it ended.

    A task that failed without running (cancelled because an input failed, or lost with its
    executor) has `start == end == 0` and only `seen`, the controller's clock when it failed.
    """

    task: int
    op: str
    executor: ExecutorLabel
    start: float
    end: float
    meta: Mapping[str, Any]
    nbytes: int = 0
    ok: bool = True
    error: str = ""
    seen: float = 0.0

    @classmethod
    def of(cls, task: TaskRecord, executor: ExecutorLabel, *, error: BaseException | None = None,
           seen: float = 0.0) -> Span:
        return cls(task=task.id, op=task.op, executor=executor, start=task.start, end=task.end,
                   meta=dict(task.meta), nbytes=task.nbytes_out, ok=error is None,
                   error="" if error is None else str(error), seen=seen)

    @property
    def ran(self) -> bool:
        return self.end > 0.0

    @property
    def duration(self) -> float:
        return max(0.0, self.end - self.start) if self.ran else 0.0

    @property
    def is_pipeline(self) -> bool:
        return is_pipeline(self.meta)

    @property
    def label(self) -> str:
        """`2F5` for stage 2, op F, microbatch 5 (the planner's action text); else the flow
        node that ran (`answer_reward`, not the generic `python`), else the op name."""
        if self.is_pipeline:
            return f"{self.meta['stage']}{self.op}{self.meta['microbatch']}"
        return str(self.meta.get("node") or self.op)


class BubbleMeter:
    """Measured pipeline bubble rate, accumulated one op at a time.

    Per executor, span = last end - first start of its pipeline ops and busy = their summed
    durations; bubble = (max span - max busy) / max span, the Zero Bubble paper's definition
    (flowkit.planner.bubble_rate, which the simulator uses too). Ops are grouped by
    their `step` so that time between training steps (generation, evaluation) is not counted as
    bubble; the run's rate is the span-weighted mean of the steps' rates.
    """

    def __init__(self) -> None:
        # step -> executor -> [first start, last end, busy]
        self._steps: dict[Hashable, dict[int, list[float]]] = {}
        # step -> (idle, max span), recomputed only for steps that got ops since the last rate():
        # a dashboard asks several times a second and a long run has thousands of steps
        self._measured: dict[Hashable, tuple[float, float]] = {}
        self._dirty: set[Hashable] = set()

    def add(self, executor: int, start: float, end: float, step: Hashable = None) -> None:
        self._dirty.add(step)
        window = self._steps.setdefault(step, {}).get(executor)
        if window is None:
            self._steps[step][executor] = [start, end, end - start]
            return
        window[0], window[1] = min(window[0], start), max(window[1], end)
        window[2] += end - start

    def add_op(self, executor: int, start: float, end: float, meta: Mapping[str, Any]) -> None:
        """Count an op that ran, if it is a pipeline op."""
        if end > 0.0 and is_pipeline(meta):
            self.add(executor, start, end, _step_key(meta.get("step")))

    def add_span(self, span: Span) -> None:
        if span.ok:
            self.add_op(span.executor.id, span.start, span.end, span.meta)

    def rate(self) -> float | None:
        """None until some pipeline op has run."""
        for step in self._dirty:
            windows = self._steps[step].values()
            spans = [last - first for first, last, _ in windows]
            rate = planner.bubble_rate(spans, [busy for _, _, busy in windows])
            self._measured[step] = (rate * max(spans), max(spans))
        self._dirty.clear()
        if not self._measured:
            return None
        total = sum(span for _, span in self._measured.values())
        idle = sum(idle for idle, _ in self._measured.values())
        return idle / total if total > 0.0 else 0.0


def is_pipeline(meta: Mapping[str, Any]) -> bool:
    """A pipeline op (F, B, W, BW of one stage and microbatch). A per-stage optimizer step
    carries a stage but no microbatch, and stays out of the bubble as in the paper."""
    return meta.get("stage") is not None and meta.get("microbatch") is not None


def bubble_rate(spans: Iterable[Span]) -> float | None:
    """The measured bubble rate of these spans (see `BubbleMeter`); None without pipeline ops."""
    meter = BubbleMeter()
    for span in spans:
        meter.add_span(span)
    return meter.rate()


def _step_key(step: Any) -> Hashable:
    return step if isinstance(step, Hashable) else repr(step)


def error_line(error: BaseException | str, limit: int = 160) -> str:
    """The first line of an error (remote errors carry a traceback after it), shortened."""
    text = str(error).strip().split("\n", 1)[0]
    return text if len(text) <= limit else text[: limit - 1] + "…"


def jsonable(value: Any) -> Any:
    """`value` with anything JSON cannot hold turned into text, so traces and metrics always
    dump: task meta may carry any msgpack-able value, and NaN is not JSON."""
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return str(value)
