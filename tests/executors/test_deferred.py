"""Deferred ops [Note: deferred ops in executors/optable.py]: a task handed to a Background stays
open while the executor runs other tasks, streams its items as the background makes them, and
completes when the background says so."""

from __future__ import annotations

import time

import pytest

from executors.optable import Deferred, _countdown
from tests.harness import op_context


@pytest.fixture(scope="module")
def one(pool):
    with pool.shared(1) as (ctl, (executor,)):
        yield ctl, executor


def test_a_deferred_task_streams_and_completes_while_other_tasks_run(one):
    ctl, executor = one
    parts = []
    counting = ctl.submit("countdown", config={"count": 4, "seconds": 0.1},
                          executor=executor.id, on_part=parts.append)
    quick = ctl.submit("identity", "meanwhile", executor=executor.id)
    assert quick.result(timeout=5) == "meanwhile"
    assert not counting.done()  # the executor ran another task while the countdown went on
    assert counting.result(timeout=10) == [0, 1, 2, 3]
    assert [p.result(timeout=5) for p in parts] == [0, 1, 2, 3]
    assert quick.timing[1] < counting.timing[1] - 0.2


def test_live_deferred_tasks_step_together(one):
    ctl, executor = one
    started = time.monotonic()
    tasks = [ctl.submit("countdown", config={"count": 5, "seconds": 0.1}, executor=executor.id)
             for _ in range(3)]
    assert [t.result(timeout=10) for t in tasks] == [[0, 1, 2, 3, 4]] * 3
    # one background step serves all three: about 6 steps of 0.1 s, not 18
    assert time.monotonic() - started < 1.5


def test_a_consumer_of_a_deferred_task_waits_for_it(one):
    ctl, executor = one
    counting = ctl.submit("countdown", config={"count": 3, "seconds": 0.05},
                          executor=executor.id)
    assert ctl.submit("identity", counting, executor=executor.id).result(timeout=5) == [0, 1, 2]


def test_a_cancelled_deferred_is_dropped_by_its_background():
    ctx = op_context()
    kept, dropped = _countdown(ctx, count=2), _countdown(ctx, count=2)
    results = []
    for deferred in (kept, dropped):
        deferred.bind(type("Sink", (), {"emit": lambda s, x: None,
                                        "done": lambda s, r, d=deferred: results.append((d, r)),
                                        "fail": lambda s, e: None})())
    dropped.cancel()
    background = ctx.background["countdown"]
    while background.busy():
        background.step()
    assert results == [(kept, [0, 1])] and dropped.cancelled


def test_a_deferred_finishes_once():
    deferred = Deferred()
    deferred.bind(type("Sink", (), {"done": lambda s, r: None})())
    deferred.done(1)
    with pytest.raises(RuntimeError, match="finishes once"):
        deferred.done(2)
