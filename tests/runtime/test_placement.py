"""Where the controller places a task no one pinned [Note: placement by load in
flowkit/runtime/dispatch.py]: on the least loaded executor, its tasks weighed by what each kind
took before, not on the one with the fewest tasks."""

LONG = {"node": "long"}  # a kind of task the controller learns takes 0.3 s


def test_a_task_goes_where_the_least_work_is_queued_not_the_fewest_tasks(cluster):
    ctl, (first, second) = cluster
    ctl.submit("sleep", config={"seconds": 0.3}, executor=first.id, meta=LONG).result(timeout=5)
    long = ctl.submit("sleep", config={"seconds": 0.3}, executor=first.id, meta=LONG)
    # two quick tasks on the other executor, waiting there for the long one's output
    waiting = [ctl.submit("identity", long, executor=second.id) for _ in range(2)]
    placed = ctl.submit("noop")
    placed.result(timeout=5)
    assert placed.location == second.id  # 2 tasks of about nothing, against one of 0.3 s
    for future in waiting:
        future.result(timeout=5)


def test_a_deferred_task_weighs_what_it_held_its_executor_not_its_span(cluster):
    """A deferred op (the engine's kind) runs in its executor's background: its 0.3 s span is
    not work queued ahead of the next task there."""
    ctl, (first, second) = cluster
    engine = {"config": {"count": 3, "seconds": 0.1}, "executor": first.id,
              "meta": {"node": "engine"}}
    ctl.submit("countdown", **engine).result(timeout=5)
    running = ctl.submit("countdown", **engine)
    blocker = ctl.submit("sleep", config={"seconds": 0.3}, executor=second.id,
                         meta={"node": "not yet timed"})
    waiting = [ctl.submit("identity", blocker, executor=second.id) for _ in range(2)]
    placed = ctl.submit("noop")
    placed.result(timeout=5)
    assert placed.location == first.id  # 1 task of about nothing held, against 3 tasks
    assert running.result(timeout=5) == [0, 1, 2]
    for future in waiting:
        future.result(timeout=5)
