"""The dashboard renders a snapshot: checked with a fixed-width capture console."""

import io
import time

import pytest
from rich.console import Console

from flowkit.observe import Dashboard, RunStats
from tests.harness import printed
from tests.observe.fakes import T0, executor, fail, join, schedule, task
from tests.observe.test_metrics import ONE_F_ONE_B, FakeClock


def _console() -> Console:
    return Console(file=io.StringIO(), width=120, force_terminal=False)


@pytest.fixture
def stats():
    """Two executors ran the 1F1B schedule (bubble 1/3) in 10 s; one still has work queued."""
    clock = FakeClock(T0)
    stats = RunStats(clock=clock)
    devices = [executor(1, name="exec-0", tags=("train",)),
               executor(2, name="exec-1", tags=("train", "gpu"))]
    join(stats, *devices)
    schedule(stats, devices, ONE_F_ONE_B)
    for op in ("W", "F"):
        stats("task_submitted", {"task": task(op, devices[0]), "executor": devices[0]})
    fail(stats, task("W", devices[1], 9, 9.5), devices[1], message="CUDA out of memory")
    clock.now = T0 + 10.0
    return stats


def _rendered(dashboard: Dashboard) -> str:
    return printed(dashboard.render(), width=120)


def test_render_shows_executors_utilization_and_run_figures(stats):
    dashboard = Dashboard(stats=stats, console=_console(), title="pretrain")
    dashboard.status = "step 3/10 loss 2.31"
    dashboard.set_metrics({"loss": 2.3125, "lr": 0.0003})
    text = _rendered(dashboard)
    lines = text.splitlines()
    row0 = next(line for line in lines if "exec-0" in line)
    row1 = next(line for line in lines if "exec-1" in line)
    # busy 6 s of the last 10 (the whole run so far); oldest op W
    assert "train" in row0 and "W" in row0 and "60%" in row0
    assert "train,gpu" in row1 and "idle" in row1 and "60%" in row1
    assert "bubble 33.3%" in text
    assert "ops 8 (0.8/s)" in text
    assert "errors 1" in text
    assert "CUDA out of memory" in text
    assert "step 3/10 loss 2.31" in text
    assert "loss 2.312" in text and "lr 0.0003" in text
    assert "pretrain" in text
    assert all(len(line) <= 120 for line in lines)


def test_render_before_anything_happened():
    text = _rendered(Dashboard(console=_console()))
    assert "no executors yet" in text and "bubble -" in text and "errors 0" in text


def test_lost_executors_are_shown_as_lost(stats):
    stats("executor_lost", {"executor": executor(2, name="exec-1"), "reason": "no heartbeat"})
    text = _rendered(Dashboard(stats=stats, console=_console()))
    assert "lost: no heartbeat" in text


def _step_record(**figures) -> dict:
    """A step's metrics line as the step loop hands it over: many figures, a few watched."""
    return {"step": 2, "step_s": 4.2049, "loss": 0.0123, "reward_mean": 0.45,
            "update_actor/loss": 0.0123, "bubble_rate": 0.2, "predicted_bubble_rate": 0.156,
            "tokens_per_s": 1234.5, **{f"timing_s/op{i}": 0.5 for i in range(20)}, **figures}


def test_plain_line_is_the_figures_a_user_watches(stats):
    dashboard = Dashboard(stats=stats, console=_console())
    dashboard.set_status("step 3/10")
    record = _step_record()
    dashboard.show_step(record, [record])
    line = dashboard.plain_line()
    assert line == "[10.0s] step 3/10 · loss 0.0123 · reward 0.45 · step 4.20s · errors 1"
    assert len(line) < 100  # not every figure of the step: those are in the metrics file


def test_plain_line_before_the_first_step_shows_the_run_is_alive(stats):
    dashboard = Dashboard(stats=stats, console=_console())
    dashboard.set_status("step 1/10")
    assert dashboard.plain_line() == "[10.0s] step 1/10 · ops 8 · errors 1"


def test_an_idle_executor_shows_0_percent_however_busy_it_was():
    clock = FakeClock(T0)
    stats, idle = RunStats(clock=clock), executor(1, name="exec-0")
    join(stats, idle)
    schedule(stats, [idle], [[("0F0", 0, 5), ("0B0", 5, 9)]])
    clock.now = T0 + 30.0  # idle for the last 21 s: more than the window
    text = printed(Dashboard(stats=stats, console=_console()).render(), width=80)
    row = next(line for line in text.splitlines() if "exec-0" in line)
    assert "idle" in row and " 0%" in row and "100%" not in row
    assert stats.snapshot().executors[0].utilization == pytest.approx(9 / 30)


def test_one_bubble_figure_with_a_legend_saying_measured_and_predicted(stats):
    dashboard = Dashboard(stats=stats, console=_console())
    record = _step_record()
    dashboard.show_step(record, [record])
    text = printed(dashboard.render(), width=100)
    assert "bubble 33.3% measured, 15.6% predicted" in text
    assert "bubble_rate" not in text  # the step's own figures stay in the metrics file
    legend = [line for line in text.splitlines() if "measured:" in line]
    assert len(legend) == 1 and "predicted:" in legend[0]
    assert all(len(line) <= 100 for line in text.splitlines())


def test_not_a_terminal_prints_plain_lines_periodically(stats):
    console = _console()
    with Dashboard(stats=stats, console=console, plain_interval_s=0.02) as dashboard:
        assert not dashboard.interactive
        deadline = time.monotonic() + 10
        while console.file.getvalue().count("[10.0s]") < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    lines = console.file.getvalue().splitlines()
    plain = [line for line in lines if line.startswith("[10.0s] ")]
    assert len(plain) >= 3  # periodic lines and the final one
    errors = [line for line in lines if "last error" in line]
    assert len(errors) == 1 and "CUDA out of memory" in errors[0]  # printed once, when new


def test_forced_live_view_renders_on_a_capture_console(stats):
    console = _console()
    with Dashboard(stats=stats, console=console, enabled=True, refresh_per_second=20):
        time.sleep(0.1)
    assert "exec-0" in console.file.getvalue()


def test_disabled_without_interval_prints_nothing(stats):
    console = _console()
    with Dashboard(stats=stats, console=console, enabled=False, plain_interval_s=None):
        pass
    assert console.file.getvalue() == ""


def test_attaches_its_own_stats_to_a_controller():
    class FakeController:
        def __init__(self):
            self.listeners = []

        def executors(self):
            return [executor(1, name="early")]

        def add_listener(self, listener):
            self.listeners.append(listener)

    ctl = FakeController()
    dashboard = Dashboard(ctl, console=_console())
    assert ctl.listeners == [dashboard.stats]
    assert "early" in _rendered(dashboard)
