"""Observers attached to a real controller with two executor processes."""

import io
import json

from rich.console import Console

from flowkit.observe import Dashboard, RunStats, TraceRecorder
from tests.harness import executor_cluster

SLEEP_S = 0.01
OPS = 6


def test_trace_has_one_span_per_op_with_a_plausible_duration(tmp_path):
    with executor_cluster(2) as (ctl, _):
        recorder, stats = TraceRecorder().attach(ctl), RunStats().attach(ctl)
        futures = [ctl.submit("sleep", config={"seconds": SLEEP_S},
                              meta={"stage": 0, "microbatch": i}) for i in range(OPS)]
        for future in futures:
            future.result(timeout=30)
        # a future may resolve on another thread a moment before the listeners hear of it
        ctl.wait_until(lambda: len(recorder.spans) == OPS, timeout=10)
        ctl.wait_until(lambda: stats.snapshot().done == OPS, timeout=10)

    spans = recorder.spans
    assert sorted(s.meta["microbatch"] for s in spans) == list(range(OPS))
    for span in spans:
        assert span.ok and span.executor.name.startswith("exec-")
        assert SLEEP_S * 0.9 <= span.duration < 5.0
    trace = json.loads(recorder.write_chrome(tmp_path / "trace.json").read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["name"] for e in complete) == sorted(f"0sleep{i}" for i in range(OPS))
    assert all(e["dur"] >= SLEEP_S * 0.9e6 for e in complete)
    names = [e for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert len(names) == 2
    snapshot = stats.snapshot()
    assert snapshot.done == OPS and snapshot.failed == 0
    assert snapshot.bubble_rate is not None and 0.0 <= snapshot.bubble_rate < 1.0
    assert snapshot.timing_s["sleep"] >= OPS * SLEEP_S * 0.9
    console = Console(file=io.StringIO(), width=120, force_terminal=False)
    console.print(Dashboard(stats=stats, console=console).render())
    assert "exec-0" in console.file.getvalue() and "exec-1" in console.file.getvalue()
