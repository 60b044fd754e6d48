"""The controller's side of early items ([Note: early items] in executors/process.py), on its
bookkeeping alone: a batched task's next items resolve their futures at once and are told to
`on_items`; items out of order, misnamed or from another executor are refused as malformed and
resolve nothing."""

import pytest

from flowkit.runtime.dispatch import Dispatcher
from flowkit.wire.protocol import Msg, ProtocolError, decode, encode
from flowkit.wire.refs import Gather
from flowkit.wire.serialize import pack
from flowkit.wire.task import TaskSpec
from tests.harness import bare_dispatcher


@pytest.fixture
def batch():
    """(dispatcher, the batched task's id, its 3 items' futures, what on_items heard)."""
    state = bare_dispatcher(("a", "b"))
    assert len(state.executors()) == 2
    heard: list = []
    futures = state.submit(TaskSpec("op", {}, items=3, per_item=(0,)), (Gather([0, 1, 2]),),
                           outputs=3, executor_id=1, tags=frozenset(), meta={},
                           on_items=heard.append)
    (task_id,) = state._tasks
    return state, task_id, futures, heard


def _items(state: Dispatcher, task_id: int, first: int, ids: list[int],
           sender: bytes = b"a") -> None:
    header, frames = decode(encode(Msg.ITEMS, {
        "task": task_id, "first": first, "start": 1.0, "end": 2.0,
        "outputs": [{"id": i, "nbytes": 1, "inline": pack(i * 10)[0]} for i in ids]}))
    state.on_message(sender, header, frames)


def test_the_next_items_resolve_at_once(batch):
    state, task_id, futures, heard = batch
    _items(state, task_id, 0, [futures[0].id, futures[1].id])
    state.run_callbacks()
    assert [f.done() for f in futures] == [True, True, False]
    assert futures[1].result() == futures[1].id * 10 and futures[1].timing == (1.0, 2.0)
    assert heard == [(0, 2)]
    _items(state, task_id, 2, [futures[2].id])
    state.run_callbacks()
    assert futures[2].done() and heard == [(0, 2), (2, 1)]


@pytest.mark.parametrize("case", ["out of order", "misnamed", "another executor"])
def test_items_that_are_not_the_next_ones_are_refused(batch, case):
    state, task_id, futures, heard = batch
    first, ids, sender = {"out of order": (1, [futures[1].id], b"a"),
                          "misnamed": (0, [futures[1].id], b"a"),
                          "another executor": (0, [futures[0].id], b"b")}[case]
    with pytest.raises(ProtocolError, match="not its next items"):
        _items(state, task_id, first, ids, sender)
    state.run_callbacks()
    assert not any(f.done() for f in futures) and heard == []


@pytest.mark.parametrize(("outputs", "error"), [
    ([], "at least one"),
    ([{"id": 5, "nbytes": "many"}], "nbytes must be an int"),
    ([{"id": 5, "inline": [1, 2]}], "inline value bytes"),
])
def test_early_items_that_would_corrupt_the_books_are_malformed(outputs, error):
    with pytest.raises(ProtocolError, match=error):
        decode(encode(Msg.ITEMS, {"task": 1, "first": 0, "end": 2.0, "outputs": outputs}))


@pytest.mark.parametrize("kind", [Msg.ITEMS, Msg.PARTS, Msg.PART])
def test_a_start_that_is_no_time_is_malformed(kind):
    fields = {"task": 1, "end": 2.0, "start": "soon"}
    output = {"id": 5, "nbytes": 0}
    fields.update({Msg.ITEMS: {"first": 0, "outputs": [output]},
                   Msg.PARTS: {"index": 0, "outputs": [output]},
                   Msg.PART: {"index": 0, "output": output}}[kind])
    with pytest.raises(ProtocolError, match="'start' must be a time"):
        decode(encode(kind, fields))


@pytest.mark.parametrize(("tasks", "error"), [
    ([3], "a task's items must be a map"),
    ([{"task": 1, "index": 0}], "missing field 'outputs'"),
    ([{"task": 1, "index": 0, "outputs": [{"id": 5}]}], "part output: missing"),
    ([{"task": 1, "index": 0, "start": "soon", "outputs": []}], "'start' must be a time"),
])
def test_a_malformed_streams_message_is_a_protocol_error(tasks, error):
    """[Note: parts in batches in executors/process.py]: several tasks' parts in one message,
    each checked as a PARTS message's."""
    with pytest.raises(ProtocolError, match=error):
        decode(encode(Msg.STREAMS, {"end": 2.0, "tasks": tasks}))


def test_a_streams_message_reads_as_a_parts_message_for_each_task():
    output = {"id": 5, "nbytes": 0}
    header, _ = decode(encode(Msg.STREAMS, {"end": 2.0, "tasks": [
        {"task": 1, "index": 0, "outputs": [output]},
        {"task": 2, "index": 3, "start": 1.0, "outputs": [output]}]}))
    assert [(b["task"], b["index"], b["end"]) for b in header["tasks"]] == [(1, 0, 2.0),
                                                                             (2, 3, 2.0)]
