"""A live view of a run: one row per executor and the run-wide figures under it.

The dashboard renders a snapshot: the controller's IO thread only updates `RunStats` counters;
rich's `Live(get_renderable=...)` asks `render()` for a fresh view a few times a second from its
own thread. When the console is not a terminal (a log file, CI), a short plain line (the step,
its loss, reward and time) is printed every few seconds instead; every figure of every step
is in the metrics file.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from flowkit.observe.metrics import ExecutorStats, RunStats, StatsSnapshot

__all__ = ["Dashboard", "sparkline", "step_figures"]


class Dashboard:
    """`with Dashboard(ctl): ...` shows the run while the block runs.

    `stats` is a `RunStats` that is already listening; without one, the dashboard makes its own
    and attaches it to `controller`. `enabled` picks the live view: True, False, or None for
    "when the console is a terminal"; without it, a plain line is printed every
    `plain_interval_s` seconds (None: print nothing). The runner sets `status` (a free-form line,
    e.g. "step 3/10 loss 2.31") and `set_metrics({...})` (figures shown under it) at any time.
    """

    def __init__(self, controller: Any = None, *, stats: RunStats | None = None,
                 console: Console | None = None, enabled: bool | None = None,
                 refresh_per_second: float = 4.0, plain_interval_s: float | None = 10.0,
                 title: str = "flowkit") -> None:
        if stats is None:
            stats = RunStats()
            if controller is not None:
                stats.attach(controller)
        self.stats = stats
        self.console = console or Console()
        self.interactive = self.console.is_terminal if enabled is None else enabled
        self.refresh_per_second = refresh_per_second
        self.plain_interval_s = plain_interval_s
        self.title = title
        self.status = ""
        self._metrics: dict[str, Any] = {}
        self._last_step: Mapping[str, Any] = {}  # the latest step's metrics line
        self._live: Live | None = None
        self._stop = threading.Event()
        self._printer: threading.Thread | None = None
        self._printed_error = ""
        self._warned: set[str] = set()

    # -- what the runner sets ------------------------------------------------------------------
    def set_status(self, text: str) -> None:
        self.status = text

    def set_metrics(self, metrics: Mapping[str, Any]) -> None:
        """Replace the user figures shown under the table (loss, reward, learning rate...)."""
        self._metrics = dict(metrics)  # a new dict: the render thread may be reading the old one

    def show_step(self, record: Mapping[str, Any], records: list[Mapping[str, Any]]) -> None:
        """Show a step's metrics line: its headline figures and the curves so far."""
        self._last_step = dict(record)
        self.set_metrics(step_figures(record, records))

    @property
    def metrics(self) -> dict[str, Any]:
        return dict(self._metrics)

    def warn(self, text: str) -> None:
        """Print `text` as a warning above the live view, the first time it is given only: a
        step's warning usually repeats every step."""
        if text not in self._warned:
            self._warned.add(text)
            self.console.print(f"warning: {text}", markup=False, highlight=False,
                               soft_wrap=True, style="yellow")

    # -- lifetime ------------------------------------------------------------------------------
    def __enter__(self) -> Dashboard:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        if self._live is not None or self._printer is not None:
            return
        if self.interactive:
            self._live = Live(get_renderable=self.render, console=self.console,
                              refresh_per_second=self.refresh_per_second)
            self._live.start()
        elif self.plain_interval_s is not None:
            self._stop.clear()
            self._printer = threading.Thread(target=self._print_periodically,
                                             name="flowkit-dashboard", daemon=True)
            self._printer.start()

    def stop(self) -> None:
        """Stop refreshing; the last view (or a last plain line) stays on the console."""
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._printer is not None:
            self._stop.set()
            self._printer.join()
            self._printer = None
            self.print_plain()

    def _print_periodically(self) -> None:
        while not self._stop.wait(self.plain_interval_s):
            self.print_plain()

    # -- rendering -----------------------------------------------------------------------------
    def render(self) -> RenderableType:
        """The view of the current snapshot: the executor table and the run-wide footer."""
        snapshot = self.stats.snapshot()
        predicted = self._last_step.get("predicted_bubble_rate")
        body = Group(_executor_table(snapshot), Text(""),
                     *_footer(snapshot, self.status, self._metrics, predicted))
        return Panel(body, title=self.title, title_align="left", expand=False)

    def plain_line(self) -> str:
        """`[1m02s] step 4/40 · loss 0.0123 · reward 0.45 · step 4.20s`: what a user watches in
        a log; before the first step ends, the ops done show that the run is alive."""
        snapshot = self.stats.snapshot()
        parts = [f"[{_elapsed(snapshot.elapsed_s)}] {self.status}".rstrip()]
        parts += _watched(self._last_step) or [f"ops {snapshot.done}"]
        if snapshot.errors:
            parts.append(f"errors {snapshot.errors}")
        return " · ".join(parts)

    def print_plain(self) -> None:
        """Print one plain line, and the last error when it is new."""
        self.console.print(self.plain_line(), markup=False, highlight=False, soft_wrap=True)
        last_error = self.stats.snapshot().last_error
        if last_error and last_error != self._printed_error:
            self._printed_error = last_error
            self.console.print(f"  last error: {last_error}", markup=False, highlight=False,
                               soft_wrap=True)


def _executor_table(snapshot: StatsSnapshot) -> Table:
    table = Table(expand=False, pad_edge=False, box=None, header_style="bold")
    table.add_column("executor")
    table.add_column("tags")
    table.add_column("op")
    for heading in ("util", "queue", "done", "failed", "bytes"):
        table.add_column(heading, justify="right")
    for executor in snapshot.executors:
        table.add_row(*_executor_cells(executor), style=None if executor.alive else "dim")
    if not snapshot.executors:
        table.add_row(Text("no executors yet", style="dim"))
    return table


def _executor_cells(executor: ExecutorStats) -> list[RenderableType]:
    if not executor.alive:
        op = Text(f"lost: {executor.lost_reason}", style="red")
    elif executor.current_op is None:
        op = Text("idle", style="dim")
    else:
        op = Text(executor.current_op)
    recent = executor.recent_utilization
    util = Text(f"{recent:.0%}", style=_utilization_style(recent))
    failed = Text(str(executor.failed), style="red" if executor.failed else "")
    # Text, not str: a str cell is read as markup, and names and tags are the executors' own
    return [Text(executor.label.name), Text(",".join(executor.label.tags) or "-"), op, util,
            str(executor.queued), str(executor.completed), failed,
            _bytes(executor.bytes_out)]


def _utilization_style(utilization: float) -> str:
    return "green" if utilization >= 0.7 else "yellow" if utilization >= 0.3 else "red"


_BUBBLE_LEGEND = ("measured: idle share of pipeline time so far · "
                  "predicted: the planner's simulation of the schedule")


def _footer(snapshot: StatsSnapshot, status: str, metrics: Mapping[str, Any],
            predicted: float | None = None) -> list[Text]:
    lines = [Text.assemble(
        ("elapsed ", "dim"), _elapsed(snapshot.elapsed_s),
        ("  ops ", "dim"), f"{snapshot.done} ({snapshot.ops_per_s:.1f}/s)",
        ("  bubble ", "dim"), _bubble(snapshot.bubble_rate, predicted),
        ("  bytes ", "dim"), _bytes(snapshot.bytes_out),
        ("  errors ", "dim"), (str(snapshot.errors), "bold red" if snapshot.errors else ""),
    )]
    if snapshot.bubble_rate is not None:  # three bubble figures unexplained read as a puzzle
        lines.append(Text(_BUBBLE_LEGEND if predicted is not None
                          else _BUBBLE_LEGEND.split(" · ")[0], style="dim"))
    if snapshot.last_error:
        lines.append(Text(f"last error: {snapshot.last_error}", style="red"))
    if status:
        lines.append(Text(status, style="bold"))
    if metrics:
        lines.append(Text("  ".join(f"{k} {_number(v)}" for k, v in metrics.items())))
    return lines


def _bubble(measured: float | None, predicted: float | None) -> str:
    if measured is None:
        return "-"
    text = f"{measured:.1%} measured"
    return text if predicted is None else f"{text}, {predicted:.1%} predicted"


def _watched(record: Mapping[str, Any]) -> list[str]:
    """The figures of a step a user watches, where the step has them."""
    parts = [f"{label} {_number(record[key])}" for key, label in
             (("loss", "loss"), ("reward_mean", "reward")) if record.get(key) is not None]
    if record.get("step_s") is not None:
        parts.append(f"step {record['step_s']:.2f}s")
    return parts


def _elapsed(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, seconds = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _bytes(count: int) -> str:
    size = float(count)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def step_figures(record: Mapping[str, Any], records: list[Mapping[str, Any]]) -> dict:
    """What the dashboard shows of a step's metrics line: losses, rewards, timings and
    throughput, and the loss and the mean reward so far as a sparkline."""
    # the bubble figures join the dashboard's one bubble figure (Dashboard.render)
    shown = {k: v for k, v in record.items()
             if k.endswith("loss") or k.startswith(("timing_s/", "reward"))
             or k in ("step_s", "tokens_per_s", "response_length_mean", "staleness/mean",
                      "staleness/max", "rollout/carried_over")}
    for key in ("loss", "reward_mean"):  # RL flows show their reward, all their loss
        values = [r[key] for r in records if r.get(key) is not None]
        if key in record and values:
            shown[f"{key} so far"] = f"{values[0]:.3g} → {values[-1]:.3g} {sparkline(values)}"
    return shown


_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 40) -> str:
    """The last `width` values as bars, lowest ▁ to highest █: a loss curve in one line."""
    values = values[-width:]
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(_BARS[min(7, int((v - low) / span * 8))] for v in values)
