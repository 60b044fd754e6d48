"""Traced items [Note: traced items in executors/tasks.py]: a task's `trace_key` field of each
output item reaches its span's meta, streamed or not, on real executors."""

from __future__ import annotations

from pathlib import Path

import pytest

from executors.tasks import summarize_completion, summarize_output
from flowkit.observe import TraceRecorder
from flowkit.ops.records import Rollout
from flowkit.runtime import RemoteError
from flowkit.wire.protocol import ProtocolError
from flowkit.wire.task import TaskSpec
from tests.runner import flowdefs

FLOWDEFS = str(Path(flowdefs.__file__))
TRICKLE = {"target": flowdefs.trickle.target, "config": {"count": 3, "gap": 0.05},
           "outputs": ["out"], "many": [True]}


def _rollout(sample: int, versions: list[int]) -> Rollout:
    return Rollout(prompt_id=7, sample=sample, prompt_tokens=[1], response_tokens=[5] * 3,
                   logprobs=[0.0] * 3, versions=versions)


def test_a_rollouts_version_span_names_it_and_bounds_its_versions():
    assert _rollout(1, [-1, 0, 2]).version_span == [7, 1, -1, 2, 3]
    assert _rollout(0, []).version_span == [7, 0, None, None, 3]


def test_describe_reports_each_items_traced_field_as_plain_data():
    items = [_rollout(0, [0, 0, 1]), _rollout(1, [1, 1, 1])]
    out = summarize_output(3, items, "prompt_id", "version_span")
    assert out["keys"] == [7, 7] and out["trace"] == [[7, 0, 0, 1, 3], [7, 1, 1, 1, 3]]
    assert summarize_output(4, items[0], trace_key="version_span")["trace"] == [[7, 0, 0, 1, 3]]
    assert "trace" not in summarize_output(5, items)
    # anything not plain data goes as its text; missing fields as None; long lists are cut
    record = flowdefs.Sample(key=1, value=2.0)
    odd = summarize_output(6, [{"k": record}, {"k": list(range(1000))}, {}], trace_key="k")["trace"]
    assert odd[0] == str(record) and odd[1] == list(range(64)) and odd[2] is None


def test_a_streamed_tasks_completion_does_not_repeat_its_parts_traces():
    done = {"task": 1, "ok": True, "start": 0.0, "end": 1.0, "outputs": [(9, [1, 2])],
            "report_key": None, "trace_key": "k",
            "streamed": [{"id": 1, "nbytes": 3, "trace": [1]}, {"id": 2, "nbytes": 3,
                                                                 "trace": [2]}]}
    assert summarize_completion(done)["outputs"] == [{"id": 9, "count": 2, "nbytes": 6}]


@pytest.mark.parametrize("bad", [5, ["version_span"], {"k": 1}])
def test_a_trace_key_that_is_not_a_field_name_is_malformed(bad):
    body = {"id": 1, "op": "noop", "config": {}, "inputs": [], "outputs": [], "trace_key": bad}
    with pytest.raises(ProtocolError, match="trace_key must be a field name"):
        TaskSpec.decode(body)


@pytest.fixture(scope="module")
def traced(pool):
    with pool.shared(2, code=[FLOWDEFS]) as (ctl, executors):
        recorder = TraceRecorder().attach(ctl)
        yield ctl, executors, recorder
        ctl.remove_listener(recorder)  # the executors go on to other tests


def _span_of(ctl, recorder, future, tag):
    future.result(timeout=10)
    ctl.wait_until(lambda: any(s.meta.get("tag") == tag for s in recorder.spans), timeout=10)
    return next(s for s in recorder.spans if s.meta.get("tag") == tag)


@pytest.mark.parametrize("streamed", [True, False])
def test_a_tasks_span_carries_its_items_traced_values_once(traced, streamed):
    ctl, _, recorder = traced
    parts, meta = [], {"node": "trickle", "tag": f"trickle-{streamed}"}
    # the same op either way: streamed, its items come one by one; else all at completion
    future = ctl.submit("python", config=TRICKLE, meta=meta, trace_key="key",
                        on_part=parts.append if streamed else None)
    span = _span_of(ctl, recorder, future, meta["tag"])
    assert len(parts) == (3 if streamed else 0)
    assert span.meta["items"] == [0, 1, 2] and span.meta["node"] == "trickle"
    assert "items" not in meta  # the caller's dict, which other tasks may share, is left alone


def test_without_a_trace_key_a_span_has_no_items(traced):
    ctl, _, recorder = traced
    future = ctl.submit("identity", [{"key": 1}], meta={"tag": "untraced"})
    assert "items" not in _span_of(ctl, recorder, future, "untraced").meta


def test_a_bad_trace_key_fails_its_task_and_the_executor_keeps_serving(traced):
    ctl, (first, _), _ = traced
    with pytest.raises(RemoteError, match="malformed task: trace_key must be a field name"):
        ctl.submit("identity", [1], executor=first.id, trace_key=5).result(timeout=5)
    copied = ctl.submit("identity", [{"key": 4}], executor=first.id, trace_key="key")
    assert copied.result(timeout=5) == [{"key": 4}]
