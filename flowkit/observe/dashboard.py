"""A live view of a run: one row per executor and the run-wide figures under it.

The dashboard renders a snapshot: the controller's IO thread only updates `RunStats` counters;
rich's `Live(get_renderable=...)` asks `render()` for a fresh view a few times a second from its
own thread. When the console is not a terminal (a log file, CI), plain
lines are printed every few seconds instead.
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
        body = Group(_executor_table(snapshot), Text(""),
                     *_footer(snapshot, self.status, self._metrics))
        return Panel(body, title=self.title, title_align="left", expand=False)

    def plain_line(self) -> str:
        """`[12.3s] ops 1520 (124.0/s) bubble 0.081 errors 0 | exec-0 util 83% q 3 op F | ...`"""
        snapshot = self.stats.snapshot()
        bubble = "-" if snapshot.bubble_rate is None else f"{snapshot.bubble_rate:.3f}"
        parts = [f"[{snapshot.elapsed_s:.1f}s] ops {snapshot.done} ({snapshot.ops_per_s:.1f}/s) "
                 f"bubble {bubble} errors {snapshot.errors}"]
        parts += [_plain_executor(executor) for executor in snapshot.executors]
        if self.status:
            parts.append(self.status)
        if self._metrics:
            parts.append(" ".join(f"{k} {_number(v)}" for k, v in self._metrics.items()))
        return " | ".join(parts)

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
    util = Text(f"{executor.utilization:.0%}", style=_utilization_style(executor.utilization))
    failed = Text(str(executor.failed), style="red" if executor.failed else "")
    # Text, not str: a str cell is read as markup, and names and tags are the executors' own
    return [Text(executor.label.name), Text(",".join(executor.label.tags) or "-"), op, util,
            str(executor.queued), str(executor.completed), failed,
            _bytes(executor.bytes_out)]


def _utilization_style(utilization: float) -> str:
    return "green" if utilization >= 0.7 else "yellow" if utilization >= 0.3 else "red"


def _footer(snapshot: StatsSnapshot, status: str, metrics: Mapping[str, Any]) -> list[Text]:
    bubble = "-" if snapshot.bubble_rate is None else f"{snapshot.bubble_rate:.1%}"
    lines = [Text.assemble(
        ("elapsed ", "dim"), _elapsed(snapshot.elapsed_s),
        ("  ops ", "dim"), f"{snapshot.done} ({snapshot.ops_per_s:.1f}/s)",
        ("  bubble ", "dim"), bubble,
        ("  bytes ", "dim"), _bytes(snapshot.bytes_out),
        ("  errors ", "dim"), (str(snapshot.errors), "bold red" if snapshot.errors else ""),
    )]
    if snapshot.last_error:
        lines.append(Text(f"last error: {snapshot.last_error}", style="red"))
    if status:
        lines.append(Text(status, style="bold"))
    if metrics:
        lines.append(Text("  ".join(f"{k} {_number(v)}" for k, v in metrics.items())))
    return lines


def _plain_executor(executor: ExecutorStats) -> str:
    if not executor.alive:
        return f"{executor.label.name} lost"
    text = f"{executor.label.name} util {executor.utilization:.0%} q {executor.queued}"
    return text if executor.current_op is None else f"{text} op {executor.current_op}"


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
    shown = {k: v for k, v in record.items()
             if k.endswith(("loss", "bubble_rate")) or k.startswith(("timing_s/", "reward"))
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
