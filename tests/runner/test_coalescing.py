"""[Note: batched per-item calls] in flowkit/runner/stepbatching.py: a per-item node sends its first
ready item at once, and while enough of its tasks are on the way the items that come meanwhile
wait and go together; groups complete at once go as one batched task. The results are those of
one call per item."""

from pathlib import Path

import pytest

from flowkit.planner.lower import lower_flow
from flowkit.runner.flowrun import FlowRunner
from tests.runner import flowdefs

FLOWDEFS = str(Path(flowdefs.__file__))
COUNT = 200


@pytest.fixture(scope="module")
def cluster(pool):
    with pool.shared(2, code=[FLOWDEFS]) as (ctl, _):
        yield ctl


def _tasks_by_node(ctl, flow, *, fuse=True):
    """(node -> the item counts of its tasks, in submission order; the runner)."""
    tasks: dict[str, list[int]] = {}

    def listen(event, payload):
        if event == "task_submitted":
            task = payload["task"]
            tasks.setdefault(task.meta.get("node"), []).append(task.items or 1)

    ctl.add_listener(listen)
    try:
        runner = FlowRunner(ctl, lower_flow(flow), fuse=fuse)
        runner.run_step(0)
    finally:
        ctl.remove_listener(listen)
    return tasks, runner


def _total(runner):
    (ref,) = runner.previous[("total", "out")].ordered()
    return ref.result(timeout=5)


def test_items_faster_than_their_consumer_coalesce_and_the_first_go_at_once(cluster):
    tasks, runner = _tasks_by_node(cluster, flowdefs.paced_flow(COUNT))
    consumer = tasks["slow_plus_one"]
    assert sum(consumer) == COUNT
    # the first items did not wait for company (on a loaded machine a few are out before the
    # run first looks), and the rest coalesced
    assert consumer[0] <= COUNT // 20, consumer
    # 10 ms an item on 2 executors, an item every 1 ms: at most 4 tasks on the way, and the
    # rest waiting together; one task an item would be 200
    assert len(consumer) < COUNT // 4, consumer
    assert _total(runner) == sum(range(COUNT)) + COUNT


def test_groups_complete_at_once_go_as_one_batched_task(cluster):
    tasks, runner = _tasks_by_node(cluster, flowdefs.paced_flow(COUNT), fuse=False)
    assert tasks["group_sum"] == [8]  # the 8 keys' groups, all complete when the stage starts
    assert _total(runner) == sum(range(COUNT)) + COUNT
