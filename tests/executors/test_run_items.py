"""How an executor runs a batched task's items (executors/tasks.py run_items): each item's
inputs picked from the per-item lists, shared inputs passed whole, outputs flattened in item
order; a batched form that answers for the wrong number of items, or an op that defers its work,
fails the task with an error that says so."""

import pytest

from executors.optable import Deferred, OpContext
from executors.tasks import ItemFailed, Task, failure_text, run_items
from flowkit.wire.task import TaskSpec

CTX = OpContext(name="test", device="cpu", tags=())


def _task(fn, *, items: int, per_item=(0,), outputs: int = 1) -> Task:
    spec = TaskSpec("op", {"scale": 10}, outputs=list(range(items * outputs)), items=items,
                    per_item=tuple(per_item))
    return Task(spec, fn)


def test_each_item_gets_its_row_and_the_shared_inputs():
    def fn(ctx, shared, x, *, scale):
        return (shared + x * scale, -x)

    task = _task(fn, items=3, per_item=(1,), outputs=2)
    assert run_items(task, CTX, [5, [1, 2, 3]], None) == [15, -1, 25, -2, 35, -3]


def test_a_batched_form_is_called_once_on_the_lists():
    calls = []

    def batched(ctx, xs, *, scale):
        calls.append(list(xs))
        return [x * scale for x in xs]

    assert run_items(_task(None, items=3), CTX, [[1, 2, 3]], batched) == [10, 20, 30]
    assert calls == [[1, 2, 3]]


def test_a_batched_form_answering_for_the_wrong_count_fails():
    with pytest.raises(TypeError, match="returned 2 for 3 items"):
        run_items(_task(None, items=3), CTX, [[1, 2, 3]], lambda ctx, xs, scale: [1, 2])


def test_a_failing_item_is_named():
    def fn(ctx, x, *, scale):
        return 1 // (x - 2)

    with pytest.raises(ItemFailed) as raised:
        run_items(_task(fn, items=3), CTX, [[1, 2, 3]], None)
    assert failure_text(raised.value) == ("ZeroDivisionError: integer division or modulo by "
                                          "zero (item 1 of the 3 this batched task ran)")


def test_an_op_that_defers_its_work_cannot_run_batched():
    with pytest.raises(TypeError, match="cannot run batched"):
        run_items(_task(lambda ctx, x, scale: Deferred(), items=2), CTX, [[1, 2]], None)
