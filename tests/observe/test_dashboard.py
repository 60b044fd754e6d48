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
    assert "train" in row0 and "W" in row0 and "60%" in row0  # busy 6 s of 10; oldest op W
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


def test_plain_line_has_the_run_and_each_executor(stats):
    dashboard = Dashboard(stats=stats, console=_console())
    dashboard.set_status("step 3/10")
    assert dashboard.plain_line() == (
        "[10.0s] ops 8 (0.8/s) bubble 0.333 errors 1 | exec-0 util 60% q 2 op W"
        " | exec-1 util 60% q 0 | step 3/10")


def test_not_a_terminal_prints_plain_lines_periodically(stats):
    console = _console()
    with Dashboard(stats=stats, console=console, plain_interval_s=0.02) as dashboard:
        assert not dashboard.interactive
        deadline = time.monotonic() + 10
        while console.file.getvalue().count("[10.0s]") < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    lines = console.file.getvalue().splitlines()
    plain = [line for line in lines if line.startswith("[10.0s] ops 8")]
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
