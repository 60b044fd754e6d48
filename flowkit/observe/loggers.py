"""Where a run's step metrics go: JSON lines, TensorBoard, Weights & Biases.

Each logger takes a step's metrics dict as `flowkit run` records it (numbers, nested dicts such as
the `staleness/versions` histogram, sometimes strings or lists). JSON lines keep the record
whole; TensorBoard and W&B get its numbers as scalars, nested keys joined with "/" (`scalars`),
and its histograms as histograms (`histograms`). Their packages are extras, imported when a
logger is opened, which `flowkit run` does before any executor starts, so a missing package is
one error naming the extra to install.

[Note: loggers on resume] A resumed run goes on from its checkpoint's step, and an interrupted
run may have logged steps past it. `rewind(step, records)` tells each logger: the JSON-lines
file is rewritten with the checkpoint's records; TensorBoard starts a new event file that purges
the events at `step` and after (what TensorBoard shows is the resumed curve); a W&B run cannot
be rewound, so the W&B logger skips steps the run already holds (they keep their first values).
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from flowkit.observe.metrics import MetricsWriter

__all__ = [
    "LOGGERS",
    "JsonLinesLogger",
    "Logger",
    "LoggerError",
    "Loggers",
    "TensorBoardLogger",
    "WandbLogger",
    "check_extras",
    "histograms",
    "import_extra",
    "scalars",
]

LOGGERS = ("jsonl", "tensorboard", "wandb")


class LoggerError(RuntimeError):
    """A logger cannot be opened: its package is missing or its service refused; the message
    says how to fix it."""


class Logger(Protocol):
    """What `flowkit run` writes each step's metrics to."""

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """The metrics of `step` (0-based, the steps of the run)."""

    def rewind(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """The run goes on from `step`, after `records` [Note: loggers on resume]."""

    def close(self) -> None: ...


# the modules each logger imports, and the extra that brings them
_NEEDS = {"tensorboard": ("tensorboard",), "wandb": ("wandb",)}


def check_extras(names: Sequence[str]) -> None:
    """A LoggerError naming the extra of the first logger in `names` whose package is
    missing: called before a logger writes anything anywhere."""
    for name in names:
        for module in _NEEDS.get(name, ()):
            import_extra(module, extra=name, logger=name)


def import_extra(module: str, *, extra: str, logger: str) -> Any:
    """`module`, or a LoggerError naming the extra that brings it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise LoggerError(
            f"--logger {logger} needs the {module.split('.')[0]} package ({exc}): install "
            f"flowkit's {extra} extra, pip install 'flowkit[{extra}]'") from None


def scalars(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of `metrics`, nested dicts flattened with "/" (`perf` {"x": 1} is
    `perf/x`) except histograms (`histograms`); strings, lists, None and booleans are left
    out, as are `step` and `time`, which the loggers carry themselves."""
    found: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            if _histogram(value) is None:
                found.update(scalars(value, f"{name}/"))
        elif _number(value) and (prefix or key not in ("step", "time")):
            found[name] = float(value)
    return found


def histograms(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, dict[float, float]]:
    """The histograms of `metrics`: nested dicts whose keys are all numbers, each a value and
    its count (`staleness/versions`: tokens per weights version). Their keys grow with the run
    (versions), so as scalars they would make a new curve per version."""
    found: dict[str, dict[float, float]] = {}
    for key, value in metrics.items():
        if isinstance(value, Mapping):
            counts = _histogram(value)
            if counts is not None:
                found[f"{prefix}{key}"] = counts
            else:
                found.update(histograms(value, f"{prefix}{key}/"))
    return found


def _number(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


def _histogram(value: Mapping) -> dict[float, float] | None:
    """`value` as {number: count}, sorted by number; None when it is not a histogram."""
    try:
        counts = {float(k): v for k, v in value.items()}
    except (TypeError, ValueError):
        return None
    if not counts or not all(_number(k) and _number(v) for k, v in counts.items()):
        return None
    return {k: float(counts[k]) for k in sorted(counts)}


class JsonLinesLogger:
    """The whole record of each step, one JSON line each (`MetricsWriter`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._writer = MetricsWriter(self.path)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._writer.write({"step": step, **metrics})

    def rewind(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        # the checkpoint's lines as they were written (their times too), then the new steps
        self._writer.close()
        self._writer = MetricsWriter(self.path)
        for record in records:
            self._writer.write(dict(record))

    def close(self) -> None:
        self._writer.close()


class TensorBoardLogger:
    """Scalars and histograms in TensorBoard event files under `folder` (`tensorboard
    --logdir`): one event a step holding all of them, written by tensorboard's own event
    writer (torch's SummaryWriter writes an event per value: 4-5x the time a step here)."""

    def __init__(self, folder: str | Path) -> None:
        check_extras(["tensorboard"])
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._pb, self._summary_pb, self._file_writer = event_pb2, summary_pb2, EventFileWriter
        self.folder = Path(folder)
        self._writer: Any = None  # opened at the first step: its purge step is that step's

    def _open(self, purge_step: int) -> None:
        """A new event file that starts with a restart at `purge_step`: TensorBoard hides
        the events of earlier files at that step and after [Note: loggers on resume]."""
        self.close()
        self._writer = self._file_writer(str(self.folder))
        self._writer.add_event(self._pb.Event(
            step=purge_step, wall_time=time.time(),
            session_log=self._pb.SessionLog(status=self._pb.SessionLog.START)))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self._writer is None:  # a fresh run: hide what an earlier run left in the folder
            self._open(step)
        summary = self._summary_pb
        values = [summary.Summary.Value(tag=name, simple_value=value)
                  for name, value in scalars(metrics).items()]
        for name, counts in histograms(metrics).items():
            limits = list(counts)  # each value is its own bucket, up to that value
            values.append(summary.Summary.Value(tag=name, histo=summary.HistogramProto(
                min=limits[0], max=limits[-1], num=sum(counts.values()),
                sum=sum(v * c for v, c in counts.items()),
                sum_squares=sum(v * v * c for v, c in counts.items()),
                bucket_limit=limits, bucket=list(counts.values()))))
        self._writer.add_event(self._pb.Event(step=step, wall_time=time.time(),
                                              summary=summary.Summary(value=values)))
        self._writer.flush()  # so a crashed or watched run shows every step written

    def rewind(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        self._open(step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbLogger:
    """A Weights & Biases run in `folder`: online, or offline when WANDB_MODE=offline (then
    `wandb sync` uploads it later). `run_id` continues that run (a resumed flowkit run)."""

    def __init__(self, folder: str | Path, *, project: str, name: str,
                 run_id: str | None = None, mode: str | None = None) -> None:
        self._wandb = import_extra("wandb", extra="wandb", logger="wandb")
        Path(folder).mkdir(parents=True, exist_ok=True)
        try:
            self._run = self._wandb.init(project=project, name=name, dir=str(folder),
                                         id=run_id, resume="allow" if run_id else None,
                                         mode=mode)
        except self._wandb.errors.Error as exc:
            self._wandb.teardown()  # as close does: nothing of this run stays for the next
            raise LoggerError(f"--logger wandb: {exc} (or run offline: WANDB_MODE=offline, "
                              "then `wandb sync` the run folder)") from None
        self.run_id: str = self._run.id
        # steps the run already holds, when it is resumed online [Note: loggers on resume]
        self._last = self._run.starting_step - 1

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if step <= self._last:
            return
        row: dict[str, Any] = dict(scalars(metrics))
        for name, counts in histograms(metrics).items():
            row[name] = self._wandb.Histogram(np_histogram=_wandb_bins(counts))
        self._run.log(row, step=step)
        self._last = step

    def rewind(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """Nothing to do: W&B keeps the steps it has [Note: loggers on resume]."""

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
            # W&B keeps its service and the settings it read from the environment for the
            # process; a later run in this process (a test, a bench round) reads them afresh
            self._wandb.teardown()


def _wandb_bins(counts: dict[float, float], most: int = 512) -> tuple[list, list]:
    """(counts, edges) with each value in a bin of its own, edges halfway between values;
    past `most` values (W&B's limit), `most` bins of equal width."""
    values = list(counts)
    if len(values) <= most:
        middles = [(a + b) / 2 for a, b in zip(values, values[1:])]
        return list(counts.values()), [values[0] - 0.5, *middles, values[-1] + 0.5]
    low, width = values[0], (values[-1] - values[0]) / most
    binned = [0.0] * most
    for value, count in counts.items():
        binned[min(most - 1, int((value - low) / width))] += count
    return binned, [low + i * width for i in range(most + 1)]


class Loggers:
    """Several loggers as one: each step goes to all of them, in order."""

    def __init__(self, loggers: Sequence[Logger] = ()) -> None:
        self.loggers = list(loggers)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for logger in self.loggers:
            logger.log(step, metrics)

    def rewind(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        for logger in self.loggers:
            logger.rewind(step, records)

    def __enter__(self) -> Loggers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close every logger, even when one fails to (the first error is raised after)."""
        errors = []
        for logger in self.loggers:
            try:
                logger.close()
            except Exception as exc:  # noqa: BLE001 - the others must still close
                errors.append(exc)
        if errors:
            raise errors[0]

