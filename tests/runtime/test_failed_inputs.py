"""A task whose inputs fail, on the controller's bookkeeping alone: it is cancelled on its
executor once, however many of its inputs failed, and an object read several times by one task
(a microbatch reads each group's samples) counts once."""

import pytest

from flowkit.runtime.dispatch import Dispatcher
from flowkit.wire.protocol import Msg, decode
from flowkit.wire.refs import Gather, Item
from flowkit.wire.task import TaskSpec
from tests.harness import bare_dispatcher


@pytest.fixture
def dispatcher():
    """(a dispatcher with executors 1 and 2, the messages it sent as decoded headers)."""
    sent: list = []

    def send_raw(frames: list) -> None:
        sent.append(decode(frames[1:])[0])

    return bare_dispatcher(("a", "b"), send_raw=send_raw), sent


def _submit(state: Dispatcher, inputs: tuple, executor: int, outputs: int = 1) -> tuple:
    return state.submit(TaskSpec("op", {}), inputs, outputs=outputs, executor_id=executor,
                        tags=frozenset(), meta={})


def _fail_producer(state: Dispatcher) -> None:
    producer = next(t for t in state._tasks.values() if t.executor == 1)
    with state.condition:
        state._fail_task(producer, RuntimeError("the producer failed"))


def _cancels(sent: list) -> list:
    return [header["tasks"] for header in sent if header["t"] == Msg.CANCEL]


def test_an_object_whose_items_a_task_reads_counts_once(dispatcher):
    state, sent = dispatcher
    (made,) = _submit(state, (), executor=1)
    (read,) = _submit(state, (Gather([Item(made, 0), Item(made, 1), Item(made, 2)]),),
                      executor=2)
    record = state._objects[made.id]
    assert record.pending == 1 and len(record.consumers) == 1
    _fail_producer(state)
    state.run_callbacks()
    assert len(_cancels(sent)) == 1 and state._executors[2].outstanding == 0
    with pytest.raises(Exception, match="the producer failed"):
        read.result(timeout=1)


def test_a_task_reading_two_failed_outputs_of_one_task_is_cancelled_once(dispatcher):
    state, sent = dispatcher
    first, second = _submit(state, (), executor=1, outputs=2)
    (read,) = _submit(state, (first, second), executor=2)
    _fail_producer(state)
    state.run_callbacks()
    (cancelled,) = _cancels(sent)
    assert cancelled == [next(iter(state._objects[first.id].consumers))]
    assert state._executors[2].outstanding == 0 and not state._executors[2].inflight
    with pytest.raises(Exception, match="the producer failed"):
        read.result(timeout=1)
