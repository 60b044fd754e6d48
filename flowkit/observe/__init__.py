"""Observability: trace recording with Chrome/Perfetto export, run statistics, step metrics as
JSON lines, to TensorBoard or to W&B (the loggers), and a rich live dashboard. Every recorder is
a controller listener (`ctl.add_listener`) that only updates counters on the controller's IO
thread; everything else reads snapshots."""

from flowkit.observe.dashboard import Dashboard
from flowkit.observe.loggers import LOGGERS, Logger, LoggerError, Loggers
from flowkit.observe.logsetup import LogSetup
from flowkit.observe.metrics import ExecutorStats, MetricsWriter, RunStats, StatsSnapshot
from flowkit.observe.spans import BubbleMeter, ExecutorLabel, Span, bubble_rate
from flowkit.observe.trace import ExecutorLoss, TraceRecorder

__all__ = [
    "BubbleMeter",
    "Dashboard",
    "ExecutorLabel",
    "ExecutorLoss",
    "ExecutorStats",
    "LOGGERS",
    "LogSetup",
    "Logger",
    "LoggerError",
    "Loggers",
    "MetricsWriter",
    "RunStats",
    "Span",
    "StatsSnapshot",
    "TraceRecorder",
    "bubble_rate",
]
