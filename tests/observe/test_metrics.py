"""RunStats figures, the measured bubble rate, and the JSON-lines metrics writer."""

import json

import pytest

from flowkit.observe import BubbleMeter, MetricsWriter, RunStats, TraceRecorder, bubble_rate
from flowkit.planner.ir import Costs
from flowkit.planner.schedules import build_schedule
from flowkit.planner.simulate import simulate
from tests.observe.fakes import T0, cancel, executor, fail, join, run, schedule, task

# 1F1B, 2 devices, 2 microbatches, F = 1 and B = 2 (no W: B is the full backward here).
#   device 0: 0F0 [0,1] 0F1 [1,2] ........ 0B0 [4,6] . 0B1 [7,9]   span 9, busy 6
#   device 1: ....... 1F0 [1,2] 1B0 [2,4] 1F1 [4,5] 1B1 [5,7]       span 6, busy 6
# bubble = (max span - max busy) / max span = (9 - 6) / 9
ONE_F_ONE_B = [
    [("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 4, 6), ("0B1", 7, 9)],
    [("1F0", 1, 2), ("1B0", 2, 4), ("1F1", 4, 5), ("1B1", 5, 7)],
]


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_bubble_of_a_hand_made_two_device_schedule():
    stats, devices = RunStats(), [executor(1), executor(2)]
    schedule(stats, devices, ONE_F_ONE_B)
    assert stats.snapshot().bubble_rate == pytest.approx(3 / 9)


def test_trace_and_stats_measure_the_same_bubble():
    recorder, devices = TraceRecorder(), [executor(1), executor(2)]
    schedule(recorder, devices, ONE_F_ONE_B)
    assert recorder.bubble_rate() == pytest.approx(3 / 9)
    assert recorder.to_chrome()["otherData"]["bubble_rate"] == pytest.approx(3 / 9)


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1", "zb-h2"])
def test_bubble_matches_the_planner_simulation(kind):
    """Replaying a simulated schedule as measured ops gives the simulator's bubble rate."""
    costs = Costs.uniform(4, F=1.0, B=1.2, W=0.8)
    result = simulate(build_schedule(kind, devices=4, microbatches=8, costs=costs), costs)
    meter = BubbleMeter()
    for device, intervals in enumerate(result.intervals):
        for interval in intervals:
            meter.add(device, T0 + interval.start, T0 + interval.end)
    assert meter.rate() == pytest.approx(result.bubble_rate)


def test_steps_are_measured_apart_so_the_gap_between_them_is_no_bubble():
    stats, devices = RunStats(), [executor(1), executor(2)]
    schedule(stats, devices, ONE_F_ONE_B, step=0)
    assert stats.snapshot().bubble_rate == pytest.approx(3 / 9)
    later = [[(text, start + 100, end + 100) for text, start, end in row] for row in ONE_F_ONE_B]
    schedule(stats, devices, later, step=1)
    assert stats.snapshot().bubble_rate == pytest.approx(3 / 9)


def test_only_pipeline_ops_count_toward_the_bubble():
    stats, a = RunStats(), executor(1)
    run(stats, task("generate", a, 0, 5), a)
    run(stats, task("optimizer", a, 5, 6, meta={"stage": 0}), a)  # no microbatch: not pipeline
    assert stats.snapshot().bubble_rate is None
    assert bubble_rate([]) is None
    run(stats, task("F", a, 6, 7, meta={"stage": 0, "microbatch": 0}), a)
    assert stats.snapshot().bubble_rate == 0.0


def test_run_stats_counts_tasks_time_bytes_and_errors():
    clock = FakeClock(T0)
    stats, a, b = RunStats(clock=clock), executor(1, tags=("gpu",)), executor(2)
    join(stats, a, b)
    run(stats, task("F", a, 0, 2, meta={"stage": 0, "microbatch": 0}, nbytes=100), a)
    run(stats, task("F", a, 2, 3, nbytes=50), a)
    run(stats, task("B", b, 3, 4), b)
    fail(stats, task("W", b, 4, 5), b, message="out of memory")
    cancel(stats, task("optimizer", b))
    clock.now = T0 + 8.0
    snap = stats.snapshot()
    assert (snap.done, snap.failed, snap.errors) == (3, 2, 1)  # the cancel repeats the failure
    assert snap.elapsed_s == pytest.approx(8.0)
    assert snap.ops_per_s == pytest.approx(3 / 8)
    assert snap.bytes_out == 150
    assert snap.timing_s == pytest.approx({"F": 3.0, "B": 1.0})
    assert snap.last_error == "W on exec-2: out of memory"
    util = {e.label.name: e.utilization for e in snap.executors}
    assert util == pytest.approx({"exec-1": 3 / 8, "exec-2": 1 / 8})


def test_current_op_is_the_oldest_outstanding_task_and_queue_counts_them():
    stats, a = RunStats(), executor(1)
    first, second = task("F", a), task("B", a)
    for record in (first, second):
        stats("task_submitted", {"task": record, "executor": a})
    (row,) = stats.snapshot().executors
    assert (row.current_op, row.queued) == ("F", 2)
    first.start, first.end = T0, T0 + 1
    stats("task_done", {"task": first, "executor": a})
    (row,) = stats.snapshot().executors
    assert (row.current_op, row.queued, row.completed) == ("B", 1, 1)
    stats("task_failed", {"task": second, "error": RuntimeError("x")})
    (row,) = stats.snapshot().executors
    assert (row.current_op, row.queued, row.failed) == (None, 0, 1)


def test_a_lost_executor_is_an_error_and_its_tasks_are_not():
    from flowkit.runtime.futures import ExecutorLost

    stats, a = RunStats(), executor(1)
    record = task("F", a)
    stats("task_submitted", {"task": record, "executor": a})
    stats("task_failed", {"task": record, "error": ExecutorLost("exec-1 was lost")})
    stats("executor_lost", {"executor": a, "reason": "its process exited with code -9"})
    snap = stats.snapshot()
    assert (snap.failed, snap.errors) == (1, 1)
    assert snap.last_error == "exec-1 lost: its process exited with code -9"
    assert not snap.executors[0].alive and snap.executors[0].queued == 0


def test_summary_uses_verl_style_keys():
    clock = FakeClock(T0 + 2)
    stats, a = RunStats(clock=clock), executor(1)
    run(stats, task("generate", a, 0, 1.5), a)
    summary = stats.summary()
    assert summary["timing_s/generate"] == pytest.approx(1.5)
    assert summary["tasks/done"] == 1
    assert summary["perf/utilization/exec-1"] == pytest.approx(0.75)
    assert summary["perf/bubble_rate"] is None


def test_metrics_lines_parse_and_carry_a_time(tmp_path):
    path = tmp_path / "out" / "metrics.jsonl"
    with MetricsWriter(path, clock=lambda: 123.5) as metrics:
        metrics.write({"step": 1, "loss": 2.5})
        assert len(path.read_text().splitlines()) == 1  # flushed at once
        metrics.write({"step": 2, "loss": float("inf"), "shape": (1, 2)})
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"time": 123.5, "step": 1, "loss": 2.5},
                     {"time": 123.5, "step": 2, "loss": None, "shape": [1, 2]}]
    with pytest.raises(ValueError, match="closed"):
        metrics.write({"step": 3})


def test_metrics_writer_appends_when_asked(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as metrics:
        metrics.write({"a": 1})
    with MetricsWriter(path, append=True) as metrics:
        metrics.write(RunStats().summary())
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records[0]["a"] == 1 and records[1]["tasks/done"] == 0


def test_recent_utilization_is_over_the_last_window_and_drops_to_0_when_idle():
    """What the dashboard shows: the share of the last 10 s spent in finished ops, so an
    executor that went idle reads 0 % and not its average so far."""
    from flowkit.observe.metrics import UTILIZATION_WINDOW_S

    assert UTILIZATION_WINDOW_S == 10.0
    clock = FakeClock(T0)
    stats, a = RunStats(clock=clock), executor(1)
    run(stats, task("F", a, 0, 5), a)
    for now, recent in [(5.0, 1.0), (10.0, 0.5), (12.0, 0.3), (15.0, 0.0), (60.0, 0.0)]:
        clock.now = T0 + now
        (row,) = stats.snapshot().executors
        assert row.recent_utilization == pytest.approx(recent), now
    assert row.utilization == pytest.approx(5 / 60)  # the whole run's, for the metrics file
    assert stats.summary()[f"perf/utilization/{a.name}"] == pytest.approx(5 / 60, abs=1e-6)
