"""Messages that try to change what they may not: a value that names a module to import, a
push from a stranger or of an object already held, an undecodable push of an awaited input
(each alone and in a batch of objects), a completion naming another task's outputs, and a
handler that raises SystemExit. Each is rejected on its own; the receiver serves on and the
run's results stay right."""

from __future__ import annotations

import contextlib
import time

import msgpack
import pytest
import zmq

from flowkit.runtime.futures import Future, RemoteError
from flowkit.wire.hello import peer_tag
from flowkit.wire.protocol import Msg, ProtocolError, encode
from flowkit.wire.serialize import pack
from flowkit.wire.task import TaskSpec
from tests.harness import bare_dispatcher, dealer, executor_cluster


@pytest.fixture(scope="module")
def pair():
    with executor_cluster(2) as (ctl, executors):
        yield ctl, executors


def _push(address: str, object_id: int, body: bytes, *, secret: bytes | None,
          tag: str | None) -> None:
    """A DATA pushed to `address`: past the gate with the run's `secret`, else a stranger's,
    dropped in its handshake."""
    header = {"object": object_id, "meta": {"body": body}}
    if tag is not None:
        header["auth"] = tag
    _send(address, secret, encode(Msg.DATA, header))


def _send(address: str, secret: bytes | None, message: list[bytes]) -> None:
    sock = dealer(address, secret=secret, linger=1000)
    with contextlib.suppress(zmq.Again):  # a stranger's connection may be gone already
        sock.send_multipart(message, zmq.NOBLOCK)
    sock.close()


def _awaited(ctl, a, b, value=5, seconds=1.0):
    """(the producer's future, a consumer on b that waits for it) while a takes `seconds`."""
    produced = ctl.submit("identity", value, config={"seconds": seconds}, executor=a.id)
    consumer = ctl.submit("identity", produced, executor=b.id)
    time.sleep(0.3)  # b holds the consumer's task, waiting for the input
    return produced, consumer


@pytest.mark.parametrize("past_the_gate", [False, True], ids=["stranger", "without-tag"])
def test_a_strangers_push_of_an_awaited_input_is_refused_and_the_real_one_counts(
        pair, past_the_gate):
    """Dropped in its handshake, or, past the gate, refused for its lack of the run's tag."""
    ctl, (a, b) = pair
    produced, consumer = _awaited(ctl, a, b)
    _push(b.peer_address, produced.id, pack(666)[0],
          secret=ctl.secret if past_the_gate else None, tag=None)
    assert consumer.result(timeout=30) == 5


def test_a_peer_cannot_replace_an_object_held(pair):
    ctl, (a, b) = pair
    held = ctl.put([1, 2], executor=b.id)
    _push(b.peer_address, held.id, pack([6, 6, 6])[0], secret=ctl.secret,
          tag=peer_tag(ctl.secret))
    time.sleep(0.2)
    assert ctl.submit("identity", held, executor=b.id).result(timeout=30) == [1, 2]


def test_a_record_naming_a_module_to_import_is_refused_and_nothing_is_imported(
        tmp_path, monkeypatch):
    """The module is importable on the executor's path and would leave a sentinel file: a
    value naming it, pushed by an insider peer, imports nothing."""
    sentinel = tmp_path / "imported"
    (tmp_path / "rogue_module.py").write_text(
        f"open({str(sentinel)!r}, 'w').close()\nimport attrs\n"
        "@attrs.define\nclass Thing:\n    x: int = 0\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    forged = msgpack.packb(msgpack.ExtType(3, msgpack.packb(["rogue_module:Thing", {}])))
    with executor_cluster(1) as (ctl, (only,)):
        _push(only.peer_address, 10**15, forged, secret=ctl.secret, tag=peer_tag(ctl.secret))
        kept = ctl.put(7, executor=only.id)  # the executor serves on
        assert ctl.submit("identity", kept, executor=only.id).result(timeout=30) == 7
        time.sleep(0.2)
    assert not sentinel.exists()


def test_an_undecodable_push_of_an_awaited_input_fails_its_task_at_once(pair):
    ctl, (a, b) = pair
    produced, consumer = _awaited(ctl, a, b, seconds=2.0)
    started = time.monotonic()
    _push(b.peer_address, produced.id, b"\xc1 not msgpack", secret=ctl.secret,
          tag=peer_tag(ctl.secret))
    with pytest.raises(RemoteError, match="could not be read"):
        consumer.result(timeout=30)
    assert time.monotonic() - started < 1.5  # not when the real push would have come
    assert produced.result(timeout=30) == 5


def _push_many(address: str, objects: list[tuple[int, bytes]], *, secret: bytes | None,
               tag: str | None, extra: dict | None = None) -> None:
    header = {"objects": [{"object": i, "body": body, **(extra or {})} for i, body in objects]}
    if tag is not None:
        header["auth"] = tag
    _send(address, secret, encode(Msg.OBJECTS, header))


def test_a_strangers_batch_of_objects_is_refused_whole(pair):
    """[Note: objects in batches in executors/outbox.py]: an OBJECTS message without the run's
    tag brings nothing in, neither the awaited input nor another object."""
    ctl, (a, b) = pair
    produced, consumer = _awaited(ctl, a, b)
    _push_many(b.peer_address, [(produced.id, pack(666)[0]), (10**15, pack(1)[0])],
               secret=ctl.secret, tag=None)
    assert consumer.result(timeout=30) == 5


def test_in_a_batch_of_objects_each_bad_one_is_refused_and_the_others_count(pair):
    """One OBJECTS message from an insider peer: a replacement of an object held, an
    undecodable awaited input and a good object, each naming a shared-memory segment too. The
    held one stays, the awaited one's task fails at once saying why, and the good one is kept
    as its plain body says (the segment is never opened): a task reads it."""
    ctl, (a, b) = pair
    held = ctl.put([1, 2], executor=b.id)
    produced, consumer = _awaited(ctl, a, b, seconds=2.0)
    good = ctl.submit("identity", 3, config={"seconds": 2.0}, executor=a.id)
    reader = ctl.submit("identity", good, executor=b.id)
    time.sleep(0.3)
    started = time.monotonic()
    _push_many(b.peer_address, [(held.id, pack([6, 6, 6])[0]),
                                (produced.id, b"\xc1 not msgpack"),
                                (good.id, pack(4)[0])], secret=ctl.secret,
               tag=peer_tag(ctl.secret),
               extra={"layout": [{"name": "flowkit-not-a-segment", "size": 1 << 30}]})
    with pytest.raises(RemoteError, match="could not be read"):
        consumer.result(timeout=30)
    assert time.monotonic() - started < 1.5  # not when the real push would have come
    assert reader.result(timeout=30) == 4  # the batch's good object came first
    assert ctl.submit("identity", held, executor=b.id).result(timeout=30) == [1, 2]
    assert produced.result(timeout=30) == 5 and good.result(timeout=30) == 3


def test_a_handler_that_raises_systemexit_rejects_its_message_and_io_goes_on(pair):
    ctl, _ = pair

    def listener(event, payload):
        if event == "task_done" and payload["task"].op == "noop":
            raise SystemExit(2)

    ctl.add_listener(listener)
    try:
        ctl.submit("noop").result(timeout=30)
        assert [ctl.submit("identity", i).result(timeout=30) for i in range(3)] == [0, 1, 2]
    finally:
        ctl.remove_listener(listener)


def _two_tasks_on_one_executor():
    """A dispatcher with one executor, "a", sent two one-output tasks: (the dispatcher, (the
    first task's output future, its task id), (the second's))."""
    state = bare_dispatcher(("a",))
    futures = [state.submit(TaskSpec("op", {}), (), outputs=1, executor_id=1,
                            tags=frozenset(), meta={})[0] for _ in range(2)]
    return state, *zip(futures, sorted(state._tasks))


def test_a_completion_naming_another_tasks_outputs_is_refused_and_its_own_still_counts():
    state, (first, first_task), (second, second_task) = _two_tasks_on_one_executor()
    none = {"nbytes": 0, "inline": pack(None)[0]}
    with pytest.raises(ProtocolError, match="names outputs that are not its own"):
        state.on_message(b"a", {"t": Msg.DONE, "items": [
            {"task": first_task, "ok": True, "outputs": [{"id": second.id, **none}]},
            {"task": second_task, "ok": True, "outputs": [{"id": second.id, **none}]}]}, [])
    state.run_callbacks()
    assert isinstance(first, Future) and not first.done()  # still its executor's to answer
    assert second.done() and second.result() is None


@pytest.mark.parametrize("bad", [
    {"start": "now"}, {"ok": 1}, {"outputs": {"id": 0}}, {"outputs": [{"id": "x"}]},
    {"outputs": [{"nbytes": "many"}]}, {"outputs": [{"trace": 3}]}, {"task": [1]}])
def test_a_malformed_completion_is_refused_alone_and_the_others_in_its_message_count(bad):
    state, (first, first_task), (second, second_task) = _two_tasks_on_one_executor()
    good = {"task": first_task, "ok": True, "start": 1.0, "end": 2.0,
            "outputs": [{"id": first.id, "inline": pack(None)[0]}]}
    malformed = {**good, "task": second_task, "outputs": [{"id": second.id, "inline": pack(
        None)[0]}]}
    for field, value in bad.items():
        if field == "outputs" and type(value) is list:
            value = [{"id": second.id, **value[0]}] if "id" not in value[0] else value
        malformed[field] = value
    with pytest.raises(ProtocolError, match="refused"):
        state.on_message(b"a", {"t": Msg.DONE, "items": [malformed, good]}, [])
    state.run_callbacks()
    assert first.done() and first.result() is None
    assert not second.done()  # nothing of the malformed one counted: still its executor's


@pytest.mark.parametrize("names", [["../rogue"], ["os/path"], ["a b"], ["x" * 3000],
                                   [str(i) for i in range(2000)], "flowkit", [3]])
def test_a_welcome_naming_anything_but_module_names_is_refused_before_any_import(names):
    from executors.process import load_declared_modules

    with pytest.raises(ProtocolError, match="dotted module names"):
        load_declared_modules(names)
