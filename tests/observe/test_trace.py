"""TraceRecorder and the Chrome trace event format it writes."""

import json

import pytest

from flowkit.observe import TraceRecorder
from tests.observe.fakes import T0, cancel, executor, fail, join, run, task


@pytest.fixture
def recorded():
    """Two executors, five ops that ran (one failed), one cancelled, one executor lost."""
    recorder = TraceRecorder(clock=lambda: T0 + 10.0)
    a, b = executor(1, tags=("rollout",)), executor(2, tags=("train", "gpu"))
    join(recorder, a, b)
    run(recorder, task("F", a, 0.5, 1.5, meta={"stage": 2, "microbatch": 5}, nbytes=64), a)
    run(recorder, task("B", b, 1.5, 3.5, meta={"stage": 1, "microbatch": 0, "step": 3}), b)
    run(recorder, task("generate", a, 2.0, 2.25), a)
    run(recorder, task("sleep", b, 4.0, 4.0), b)  # an op can take no measurable time
    fail(recorder, task("W", b, 5.0, 6.0, meta={"stage": 1, "microbatch": 0}), b)
    cancel(recorder, task("optimizer", b))
    recorder("executor_lost", {"executor": b, "reason": "no heartbeat for 2.0 s"})
    return recorder


def _events(trace, ph):
    return [e for e in trace["traceEvents"] if e["ph"] == ph]


def test_every_op_that_ran_is_one_complete_event(recorded):
    trace = recorded.to_chrome()
    complete = _events(trace, "X")
    assert len(complete) == 5
    for event in complete:
        assert isinstance(event["ts"], int | float) and event["ts"] >= 0
        assert isinstance(event["dur"], int | float) and event["dur"] >= 0
        assert {"name", "cat", "pid", "tid", "args"} <= event.keys()
    first = min(complete, key=lambda e: e["ts"])
    assert first["ts"] == 0  # relative to the first event
    assert first["dur"] == pytest.approx(1e6)  # microseconds


def test_names_follow_the_action_text_and_categories_the_op(recorded):
    by_cat = {e["cat"]: e for e in _events(recorded.to_chrome(), "X")}
    assert by_cat["F"]["name"] == "2F5"
    assert by_cat["B"]["name"] == "1B0"
    assert by_cat["generate"]["name"] == "generate"
    assert by_cat["F"]["args"] == {"stage": 2, "microbatch": 5, "task": by_cat["F"]["args"]["task"],
                                   "bytes": 64}
    assert by_cat["B"]["args"]["step"] == 3
    assert by_cat["F"]["pid"] == 1 and by_cat["B"]["pid"] == 2


def test_one_process_row_per_executor_named_with_its_tags(recorded):
    metadata = _events(recorded.to_chrome(), "M")
    names = {e["pid"]: e["args"]["name"] for e in metadata if e["name"] == "process_name"}
    assert names == {1: "exec-1 [rollout]", 2: "exec-2 [train,gpu]"}
    threads = [e for e in metadata if e["name"] == "thread_name"]
    assert sorted(e["pid"] for e in threads) == [1, 2]


def test_failures_are_marked_and_losses_are_instant_events(recorded):
    trace = recorded.to_chrome()
    failed = [e for e in _events(trace, "X") if "error" in e["args"]]
    assert [e["name"] for e in failed] == ["1W0"]
    assert failed[0]["cname"] == "terrible"
    assert "boom" in failed[0]["args"]["error"]
    instants = _events(trace, "i")
    assert {e["name"] for e in instants} == {"optimizer (not run)", "exec-2 lost"}
    lost = next(e for e in instants if e["cat"] == "executor_lost")
    assert lost["pid"] == 2 and lost["s"] == "p"
    assert lost["args"]["reason"] == "no heartbeat for 2.0 s"
    assert lost["ts"] == pytest.approx(9.5e6)


def test_written_file_is_valid_json_with_the_trace_keys(recorded, tmp_path):
    path = recorded.write_chrome(tmp_path / "deep" / "trace.json")
    loaded = json.loads(path.read_text())
    assert loaded == json.loads(json.dumps(recorded.to_chrome()))
    assert set(loaded) >= {"traceEvents", "displayTimeUnit"}
    assert loaded["displayTimeUnit"] == "ms"
    assert loaded["otherData"]["origin_unix_s"] == T0 + 0.5


def test_meta_that_json_cannot_hold_becomes_text():
    recorder = TraceRecorder()
    a = executor(1)
    run(recorder, task("F", a, 0, 1, meta={"stage": 0, "microbatch": 0, "shape": (2, 3),
                                           "loss": float("nan"), "obj": object()}), a)
    args = _events(json.loads(json.dumps(recorder.to_chrome(), allow_nan=False)), "X")[0]["args"]
    assert args["shape"] == [2, 3] and args["loss"] is None and args["obj"].startswith("<object")


def test_an_executor_seen_first_by_id_gets_its_name_later():
    recorder = TraceRecorder()
    a = executor(7, name="late-joiner")
    cancel(recorder, task("F", a))
    assert recorder.executors[0].name == "executor-7"
    run(recorder, task("F", a, 0, 1), a)
    assert [e.name for e in recorder.executors] == ["late-joiner"]


def test_max_spans_keeps_the_latest():
    recorder = TraceRecorder(max_spans=2)
    a = executor(1)
    for i in range(5):
        run(recorder, task(f"op{i}", a, i, i + 0.5), a)
    assert [s.op for s in recorder.spans] == ["op3", "op4"]
    assert recorder.dropped == 3
    assert recorder.to_chrome()["otherData"]["dropped_spans"] == 3


def test_an_empty_trace_is_still_valid():
    trace = TraceRecorder().to_chrome()
    assert trace["traceEvents"] == [] and json.loads(json.dumps(trace))["displayTimeUnit"] == "ms"
