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
