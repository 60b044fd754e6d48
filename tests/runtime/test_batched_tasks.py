"""Batched tasks [Note: batched tasks in flowkit/wire/task.py] on real executors: many items of a
per-item op in one task, one message out and one completion back, each item's outputs a future
of its own; shared inputs once; a failing item fails them all, saying which; an op's batched
form gives what the op gives on each item."""

import pytest

from flowkit.ops.records import Rollout
from flowkit.runtime import Item, RemoteError, wait
from tests.harness import executor_cluster

ADD = {"target": "tests.runtime.batch_ops:add", "ports": ["x", "y"]}


def _tasks_done(ctl) -> list:
    done = []
    ctl.add_listener(lambda event, payload: done.append(payload["task"])
                     if event == "task_done" else None)
    return done


def test_items_run_in_one_task_each_with_its_own_future(cluster):
    ctl, (first, second) = cluster
    done = _tasks_done(ctl)
    values = ctl.put(list(range(10)), executor=first.id)
    futures = ctl.submit_items("python", [Item(values, i) for i in range(10)], 100,
                               per_item=[0], config={**ADD}, executor=second.id)
    assert [f.result(timeout=10) for f in futures] == [100 + i for i in range(10)]
    assert [task.op for task in done] == ["python"]  # one task for the ten
    assert all(f.location == second.id for f in futures)


def test_shared_and_per_item_inputs_in_any_position(cluster):
    ctl, _ = cluster
    xs = [ctl.put(i) for i in range(3)]
    futures = ctl.submit_items("python", 7, xs, per_item=[1], config={**ADD})
    assert [f.result(timeout=10) for f in futures] == [7, 8, 9]


def test_items_of_several_outputs_come_back_as_tuples(cluster):
    ctl, _ = cluster
    pairs = ctl.submit_items("identity", [[1, 2], [3, 4]], per_item=[0], outputs=2)
    assert [(a.result(timeout=10), b.result(timeout=10)) for a, b in pairs] == [(1, 2), (3, 4)]


def test_a_failing_item_fails_every_item_saying_which(cluster):
    ctl, _ = cluster
    futures = ctl.submit_items("python", [1, 2, 3, 4], per_item=[0],
                               config={"target": "tests.runtime.batch_ops:fail_on_three",
                                       "ports": ["x"]})
    for future in futures:
        with pytest.raises(RemoteError, match=r"ValueError: three is not allowed \(item 2 of "
                                              r"the 4 this batched task ran\)"):
            future.result(timeout=10)
    downstream = ctl.submit("identity", futures[0])
    with pytest.raises(RemoteError, match="not run"):
        downstream.result(timeout=10)
    assert ctl.submit("identity", 5).result(timeout=10) == 5  # the executor serves on


@pytest.mark.parametrize("inputs", [[], [[1, 2], [3]]])
def test_bad_item_lists_are_refused_before_anything_is_sent(cluster, inputs):
    ctl, _ = cluster
    with pytest.raises(ValueError, match="per_item"):
        ctl.submit_items("identity", *inputs, per_item=list(range(len(inputs))))


def test_a_batched_form_gives_what_the_op_gives_per_item(start_cluster):
    ctl, (executor,) = start_cluster(1, kind="sim")
    rollouts = [Rollout(prompt_id=p, sample=s, prompt_tokens=[1, 2], response_tokens=[3] * p,
                        logprobs=[-1.0] * p) for p in range(1, 4) for s in range(2)]
    done = _tasks_done(ctl)
    batched = ctl.submit_items("logprobs", rollouts, per_item=[0])
    alone = [ctl.submit("logprobs", r) for r in rollouts]
    assert [f.result(timeout=10) for f in batched] == [f.result(timeout=10) for f in alone]
    assert len(done) == 1 + len(rollouts)


def test_items_finished_while_a_slow_one_runs_are_answered_early(cluster):
    ctl, _ = cluster
    early = []
    futures = ctl.submit_items("python", [0, 1, 2, 3], per_item=[0], on_items=early.append,
                               config={"target": "tests.runtime.batch_ops:slow_on_last",
                                       "ports": ["x"]})
    ctl.wait_until(lambda: futures[2].done(), timeout=10)
    assert not futures[3].done()  # still sleeping: the first three came before it
    ctl.wait_until(lambda: sum(count for _, count in early) >= 3, timeout=10)  # callbacks run
    assert early[0][0] == 0  # after the futures resolve
    assert [f.result(timeout=10) for f in futures] == [0, 1, 2, 3]
    # an item answered early is an object like any other: tasks read it, wherever they run
    assert ctl.submit("python", futures[1], 10, config={**ADD}).result(timeout=10) == 11


def test_a_traced_batched_task_reports_each_items_field(cluster):
    # a batched task's span lists every item's traced field, as a task's does for its outputs
    ctl, _ = cluster
    done = _tasks_done(ctl)
    records = [{"version": v} for v in (3, 4, 5)]
    futures = ctl.submit_items("identity", records, per_item=[0], trace_key="version",
                               meta={"node": "n", "batch_items": 3})
    assert [f.result(timeout=10) for f in futures] == records
    assert done[-1].meta["items"] == [3, 4, 5] and done[-1].meta["batch_items"] == 3


def test_a_push_goes_out_while_a_burst_of_short_tasks_runs():
    """[Note: serving between tasks] in executors/process.py: an executor running hundreds of
    short tasks back to back still serves what arrives behind them every millisecond, such as
    the controller's request to push an object to a peer."""
    with executor_cluster(2) as (ctl, (busy, other)):
        made = ctl.submit("identity", "v" * 10000, executor=busy.id)  # too big to ride inline
        made.result(timeout=10)
        # one message of 20,000 no-ops ahead of the push, each too short for the watch to take
        # the sockets over while it runs [Note: completion batching]
        with ctl.batch():
            burst = [ctl.submit("noop", executor=busy.id) for _ in range(20000)]
        read = ctl.submit("identity", made, executor=other.id)
        assert read.result(timeout=30) == "v" * 10000
        assert sum(f.done() for f in burst) < len(burst)  # pushed in the middle of them
        wait(burst)
