"""A synchronous run calls its next step's sources while a step runs [Note: sources ahead in
flowkit/runner/sources_ahead.py]: the same results, each source called once a step, a failure
in the step it belongs to."""

from pathlib import Path

import pytest

from flowkit.planner.lower import lower_flow
from flowkit.runner.flowrun import FlowRunError, FlowRunner
from flowkit.runner.submission import STREAM_WINDOW
from tests.runner import flowdefs

FLOWDEFS = str(Path(flowdefs.__file__))


@pytest.fixture(scope="module")
def one_executor(pool):
    with pool.shared(1, kind="sim", tags=("train", "rollout"), code=[FLOWDEFS]) as (ctl, _):
        yield ctl


def _run(ctl, flow, steps: int | None, count: int = 3, between=None, node="step_samples",
         total="total"):
    """Each step's total and the steps the source was called for, in order; `steps`: the run's
    length the runner is told (None: none, so nothing is called ahead)."""
    calls = []

    def listen(event, payload):
        task = payload.get("task")
        if event == "task_submitted" and (task.meta or {}).get("node") == node:
            calls.append(task.meta["step"])

    ctl.add_listener(listen)
    try:
        runner = FlowRunner(ctl, lower_flow(flow), steps=steps, step_timeout=30)
        totals, starts = [], []
        for step in range(count):
            if step and between is not None:
                between()
            runner.run_step(step)
            (ref,) = runner.previous[(total, "out")].ordered()
            totals.append(ref.result(timeout=5))
            starts.append((runner.states[node].first_start, runner.states[total].last_end))
    finally:
        ctl.remove_listener(listen)
    return totals, calls, starts


def test_the_next_steps_source_runs_during_the_step_and_changes_nothing(one_executor):
    flow = flowdefs.stepped_flow(count=8, delay=0.3)
    ahead, calls, starts = _run(one_executor, flow, steps=3)
    plain, plain_calls, _ = _run(one_executor, flow, steps=None)
    assert ahead == plain == [sum(2 * (s * 1000 + i) for i in range(8)) for s in range(3)]
    assert calls == plain_calls == [0, 1, 2]  # once a step, none past the run's last
    for (_, step_end), (next_start, _) in zip(starts, starts[1:]):
        assert next_start < step_end  # called while the step before ran


def test_a_stream_longer_than_the_credit_window_does_not_stall_the_step_before(one_executor):
    # one executor: were the source's items called ahead not credited, its call would wait
    # for credits there while the step before waited behind it
    count = STREAM_WINDOW + 200
    totals, _, _ = _run(one_executor, flowdefs.stepped_flow(count=count), steps=2, count=2)
    assert totals == [sum(2 * (s * 1000 + i) for i in range(count)) for s in range(2)]


@pytest.fixture(scope="module")
def source_and_work(pool):
    with pool.shared(2, kind="sim", tags=[("src",), ("work",)], code=[FLOWDEFS]) as (ctl, infos):
        yield ctl, next(e.id for e in infos if "src" in e.tags)


def test_a_source_called_ahead_streams_on_between_steps_when_the_run_reads_nothing(
        source_and_work):
    # step 1's source streams on its own executor, past the window, after step 0 has ended on
    # the other: a task sent to the source's executor between the steps (an evaluation's, a
    # checkpoint's) runs once the source is done instead of waiting on its credits for ever
    ctl, source = source_and_work
    count = STREAM_WINDOW + 200
    ran = []
    totals, _, _ = _run(ctl, flowdefs.split_flow(count=count, gap=0.0005), steps=2, count=2,
                        node="step_samples_on_src", total="total_on_work",
                        between=lambda: ran.append(ctl.submit("noop", config={},
                                                              executor=source).result(20)))
    assert totals == [sum(s * 1000 + i + 1 for i in range(count)) for s in range(2)]
    assert len(ran) == 1


def test_a_source_called_ahead_that_fails_fails_its_own_step(one_executor):
    runner = FlowRunner(one_executor, lower_flow(flowdefs.stepped_flow(fail_at=1)), steps=3,
                        step_timeout=30)
    runner.run_step(0)
    with pytest.raises(FlowRunError, match="step 1: op 'step_samples' failed.*no samples"):
        runner.run_step(1)
