"""Tensors between executors: shared memory on one host, chunked frames across hosts, segments
that never outlive their run, and malformed transfers that are refused without harm."""

import contextlib
import os
import signal
import time

import pytest
import torch

from flowkit.runtime import ExecutorLost, RemoteError, wait
from flowkit.runtime.forkserver import ForkedProcess
from flowkit.wire.hello import peer_tag
from flowkit.wire.protocol import Msg, encode
from flowkit.wire.serialize import SerializeError, pack, unpack
from flowkit.wire.shm import (
    CHUNK_BYTES,
    PeerTransport,
    SegmentPool,
    leftover_segments,
    sweep,
)
from tests.harness import dealer, executor_cluster, process_of

MiB = 1 << 20


def _pattern(nbytes: int) -> torch.Tensor:
    """What the built-in op make_tensor makes: byte i is i % 251."""
    return torch.arange(251, dtype=torch.uint8).repeat(nbytes // 251 + 1)[:nbytes]


@contextlib.contextmanager
def _cluster(count: int = 2):
    """Yields (controller, executor infos by name); on exit, checks that the executors' own exit
    removed their segments before the launcher's sweep could."""
    with executor_cluster(count) as (controller, infos):
        yield controller, infos
        controller.shutdown()
        for info in infos:
            process_of(controller, info).wait(timeout=10)
        left = leftover_segments(info.pid for info in infos)
    assert left == [], f"executors exited leaving {left}"


def _round_trip(tx: PeerTransport, rx: PeerTransport, value, host=None):
    """Send `value` from `tx` to `rx`, which is on `host` (rx's own host id unless given)."""
    body, frames = pack(value)
    meta, wire = tx.encode(body, frames, rx.host if host is None else host)
    received = rx.decode(meta, list(wire))
    try:
        return meta, unpack(body, received)
    finally:
        received.clear()


# -- the transport in one process ----------------------------------------------------------------
def test_large_frames_go_by_handle_small_ones_inline_and_segments_are_reused():
    tx, rx = PeerTransport(), PeerTransport()
    try:
        big, small = torch.randn(512, 1024), torch.arange(10)
        meta, (got_big, got_small) = _round_trip(tx, rx, (big, small))
        assert meta["layout"][0][0] == "shm" and meta["layout"][1] == 1
        assert torch.equal(got_big, big) and torch.equal(got_small, small)
        (segment,) = tx.pool.segments
        assert segment.lent()
        view = got_big[3:5]
        del got_big
        assert segment.lent()  # a view still uses the storage
        del view
        assert not segment.lent()  # the last view went: the segment is the sender's again
        meta, again = _round_trip(tx, rx, big * 2)
        assert tx.pool.segments == [segment] and torch.equal(again, big * 2)
    finally:
        tx.close()
        rx.close()
    assert leftover_segments([os.getpid()]) == []


def test_frames_to_another_host_are_chunked_and_joined():
    tx, rx = PeerTransport(host="host-a"), PeerTransport(host="host-b")
    value = {"odd": _pattern(3 * MiB + 123), "t": torch.randn(700, 600).t(), "n": 7}
    meta, got = _round_trip(tx, rx, value)
    assert meta["layout"] == [4, 2]  # 1 MiB chunks; no shared memory
    assert torch.equal(got["odd"], value["odd"]) and torch.equal(got["t"], value["t"])
    assert got["n"] == 7 and not tx.pool.segments


def test_frames_from_another_host_are_joined_in_pooled_buffers_reused_once_freed():
    tx, rx = PeerTransport(host="host-a"), PeerTransport(host="host-b")
    try:
        _, got = _round_trip(tx, rx, _pattern(3 * MiB))
        (buffer,) = rx.received.segments
        assert buffer.lent() and torch.equal(got, _pattern(3 * MiB))
        view = got[5:9]
        del got
        assert buffer.lent()  # a view still uses it
        del view
        assert not buffer.lent()
        _, again = _round_trip(tx, rx, _pattern(2 * MiB + 1))
        assert rx.received.segments == [buffer] and torch.equal(again, _pattern(2 * MiB + 1))
        rx.received.max_bytes = 0  # full: a join gets fresh memory, and the pool keeps none
        _, fresh = _round_trip(tx, rx, _pattern(5 * MiB))
        assert torch.equal(fresh, _pattern(5 * MiB)) and rx.received.segments == [buffer]
    finally:
        tx.close()
        rx.close()


def test_forced_frames_never_use_shared_memory_even_on_one_host():
    tx, rx = PeerTransport(force_frames=True), PeerTransport()
    meta, got = _round_trip(tx, rx, _pattern(2 * MiB))
    assert meta["layout"] == [2] and not tx.pool.segments and torch.equal(got, _pattern(2 * MiB))


def test_unlink_all_and_sweep_remove_names():
    pool = SegmentPool()
    handle = pool.put(memoryview(bytearray(2 * MiB)))
    name = handle[1]
    assert name == f"flowkit-{os.getpid()}-1" and leftover_segments([os.getpid()]) == [name]
    pool.unlink_all()
    assert leftover_segments([os.getpid()]) == []
    pool.close()
    pool = SegmentPool()
    pool.put(memoryview(bytearray(2 * MiB)))
    assert sweep([os.getpid()]) == [f"flowkit-{os.getpid()}-1"]
    pool.close()


@pytest.mark.parametrize("layout, wire, match", [
    ("nope", [], "layout must be a list"),
    ([3], [b"a", b"b"], "wants 3 more frames"),
    ([1], [b"a", b"b"], "layout names 1"),
    ([["shm", "../../etc/passwd", 4096, 10, "h"]], [], "not a flowkit shared-memory"),
    ([["shm", "flowkit-1-999999", 4096, 10, None]], [], "is on host"),
    ([["shm", "flowkit-1"]], [], "malformed shared-memory handle"),
    ([["shm", "flowkit-1-1", -1, 10, None]], [], "bad offset"),
])
def test_malformed_layouts_are_serialize_errors(layout, wire, match):
    rx = PeerTransport()
    with pytest.raises(SerializeError, match=match):
        rx.decode({"body": b"", "layout": layout}, wire)


def test_handles_past_the_segment_or_not_lent_are_refused():
    pool, rx = SegmentPool(), PeerTransport()
    try:
        handle = pool.put(memoryview(bytearray(2 * MiB)))
        too_long = [*handle[:3], 1 << 40, handle[4]]
        with pytest.raises(SerializeError, match="reaches past segment"):
            rx.decode({"body": b"", "layout": [too_long]}, [])
        pool.segments[0].mm[0] = 0  # given back already: an old handle must not map it again
        with pytest.raises(SerializeError, match="not lent out"):
            rx.decode({"body": b"", "layout": [handle]}, [])
        missing = ["shm", f"flowkit-{os.getpid()}-77", 4096, 10, rx.host]
        with pytest.raises(SerializeError, match="cannot open"):
            rx.decode({"body": b"", "layout": [missing]}, [])
    finally:
        pool.close()


# -- real executor processes ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair():
    """One cluster for the tests that leave it as they found it (cluster starts cost seconds)."""
    with _cluster() as (ctl, (a, b)):
        yield ctl, a, b


@pytest.mark.parametrize("mib", [4, 64])
def test_large_tensors_move_executor_to_executor_through_shared_memory(pair, mib):
    ctl, a, b = pair
    made = ctl.submit("make_tensor", config={"nbytes": mib * MiB}, executor=a.id)
    moved = ctl.submit("identity", made, executor=b.id)
    assert ctl.submit("nbytes", moved, executor=b.id).result(timeout=30) == mib * MiB
    assert leftover_segments([a.pid])  # lent to b, which still holds it
    assert torch.equal(moved.result(timeout=30), _pattern(mib * MiB))
    assert moved.location == b.id


def test_dtypes_layouts_and_records_arrive_intact(pair):
    ctl, a, b = pair
    value = {
        "strided": torch.randn(1024, 768).t()[::2],  # non-contiguous
        "int": torch.arange(400_000, dtype=torch.int64).reshape(400, 1000),
        "half": torch.randn(1 << 20, dtype=torch.bfloat16),
        "small": torch.tensor([1, 2, 3]),
        "items": [torch.zeros(3, dtype=torch.bool), "text", 1.5],
    }
    placed = ctl.put(value, executor=a.id)
    got = ctl.submit("identity", placed, executor=b.id).result(timeout=30)
    for key in ("strided", "int", "half", "small"):
        assert got[key].dtype == value[key].dtype and torch.equal(got[key], value[key]), key
    assert torch.equal(got["items"][0], value["items"][0]) and got["items"][1:] == ["text", 1.5]


def test_numpy_arrays_arrive_intact(pair):
    numpy = pytest.importorskip("numpy")
    ctl, a, b = pair
    array = numpy.arange(600_000, dtype=numpy.float32).reshape(600, 1000)[:, ::3]
    moved = ctl.submit("identity", ctl.put(array, executor=a.id), executor=b.id)
    got = moved.result(timeout=30)
    assert got.dtype == array.dtype and (got == array).all()


@pytest.mark.slow
def test_forced_frames_path_moves_data_without_shared_memory(monkeypatch):
    monkeypatch.setenv("FLOWKIT_PEER_TRANSPORT", "frames")
    with _cluster() as (ctl, (a, b)):
        made = ctl.submit("make_tensor", config={"nbytes": 5 * MiB + 7}, executor=a.id)
        moved = ctl.submit("identity", made, executor=b.id)
        got = moved.result(timeout=30)
        assert leftover_segments([a.pid, b.pid]) == []
    assert torch.equal(got, _pattern(5 * MiB + 7)) and CHUNK_BYTES == MiB


def test_segments_go_back_to_the_pool_when_the_consumer_frees_them(pair):
    ctl, a, b = pair
    base = ctl.submit("make_tensor", config={"nbytes": 8 * MiB}, executor=a.id)
    wait([base])
    before = len(leftover_segments([a.pid]))
    for _ in range(8):
        moved = ctl.submit("identity", base, executor=a.id)
        assert ctl.submit("nbytes", moved, executor=b.id).result(timeout=30) == 8 * MiB
        del moved
        time.sleep(0.1)  # frees go out in batches
    assert len(leftover_segments([a.pid])) <= before + 1


@pytest.mark.slow
def test_no_segment_is_left_after_an_op_fails():
    with _cluster() as (ctl, (a, b)):
        made = ctl.submit("make_tensor", config={"nbytes": 4 * MiB}, executor=a.id)
        with pytest.raises(RemoteError, match="failed on purpose"):
            ctl.submit("fail", made, executor=b.id).result(timeout=30)
        assert leftover_segments([a.pid])


@pytest.mark.slow
def test_a_killed_executor_leaves_no_segment_after_the_run():
    with _cluster() as (ctl, (a, b)):
        made = ctl.submit("make_tensor", config={"nbytes": 4 * MiB}, executor=a.id)
        moved = ctl.submit("identity", made, executor=b.id)
        wait([moved], timeout=30)
        later = ctl.submit("sleep", made, config={"seconds": 30}, executor=a.id)
        os.kill(a.pid, signal.SIGKILL)
        with pytest.raises(ExecutorLost):
            later.result(timeout=30)
        assert torch.equal(moved.result(timeout=30), _pattern(4 * MiB))  # b's mapping works
        process = process_of(ctl, a)
        process.wait(timeout=10)
        if isinstance(process, ForkedProcess):  # its fork server swept as it reaped it
            assert leftover_segments([a.pid]) == []
        else:
            assert leftover_segments([a.pid])  # nobody could unlink them yet
        sweep([a.pid])  # what LocalExecutors.stop does; _cluster checks the rest is clean
    assert leftover_segments([a.pid, b.pid]) == []


def _send_data(address: str, secret: bytes, layout, frames: list, body: bytes) -> None:
    tag = peer_tag(secret)
    sock = dealer(address, secret=secret, linger=1000)
    sock.send_multipart(encode(Msg.DATA, {"object": 10**9, "auth": tag, "meta": {
        "body": body, "layout": layout}}, frames))
    sock.close()


@pytest.mark.slow
def test_truncated_handles_and_chunks_are_refused_and_the_executor_keeps_serving(capfd):
    """From a peer of the run (its tag): each is refused, in the executor's own log (a line a
    kind a while, [Note: refusals] in flowkit/wire/refusals.py), and it serves on."""
    body, frames = pack(torch.zeros(3 * MiB, dtype=torch.uint8))
    chunks = [bytes(MiB), bytes(MiB), bytes(MiB // 2)]  # the last chunk cut short
    with _cluster() as (ctl, (a, b)):
        secret = ctl.secret
        _send_data(b.peer_address, secret, [3], chunks, body)
        _send_data(b.peer_address, secret, [3], chunks[:2], body)  # a chunk missing
        _send_data(b.peer_address, secret, [["shm", f"flowkit-{a.pid}-404", 4096, 3 * MiB, "?"]],
                   [], body)
        _send_data(b.peer_address, secret, [["shm", "flowkit-x"]], [], body)
        _send_data(b.peer_address, secret, [1], [b"\x00" * 10], b"\xc1garbage")
        deadline, logged = time.monotonic() + 10, ""
        while time.monotonic() < deadline and "rejected a message from a peer" not in logged:
            assert ctl.submit("identity", 5, executor=b.id).result(timeout=10) == 5
            time.sleep(0.05)
            logged += capfd.readouterr().err
        assert "rejected a message from a peer" in logged and "run tag" not in logged
        moved = ctl.submit("identity", ctl.submit("make_tensor", config={"nbytes": 2 * MiB},
                                                  executor=a.id), executor=b.id)
        assert torch.equal(moved.result(timeout=30), _pattern(2 * MiB))
