"""[Note: header limits in flowkit/wire/protocol.py]: a header whose arrays or maps claim more
items than any message carries is refused as msgpack reads the lengths, before allocation."""

from __future__ import annotations

import resource
import time

import msgpack
import pytest

from flowkit.wire.protocol import PROTOCOL_VERSION, Msg, decode, encode
from flowkit.wire.schema import ProtocolError
from flowkit.wire.task import MAX_ITEMS


def _done(items: list) -> list:
    return encode(Msg.DONE, {"items": items})


def test_a_done_of_a_million_items_is_refused_before_it_is_built():
    header = msgpack.packb({"v": PROTOCOL_VERSION, "t": Msg.DONE,
                            "items": [{"task": 1}] * 1_000_000})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with pytest.raises(ProtocolError, match="header is not msgpack.*exceeds max_array_len"):
        decode([header])
    assert time.perf_counter() - start < 0.5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB


def test_a_map_of_too_many_keys_is_refused_too():
    header = msgpack.packb({"v": PROTOCOL_VERSION, "t": Msg.DONE, "items": [],
                            "x": {str(i): 0 for i in range(300_000)}})
    with pytest.raises(ProtocolError, match="exceeds max_map_len"):
        decode([header])


def test_the_most_items_a_message_carries_still_decode():
    items = [{"task": i, "ok": True, "start": 0.0, "end": 0.0} for i in range(MAX_ITEMS)]
    header, _ = decode(_done(items))
    assert len(header["items"]) == MAX_ITEMS


def _nested(kind: str, count: int) -> bytes:
    """A header of `count` objects, nested so that no array passes max_array_len."""
    per, outputs = 8, [{"id": 1, "nbytes": 0}] * (count // 8)
    if kind == Msg.STREAMS:
        fields = {"end": 1.0, "tasks": [{"task": 1, "index": 0, "outputs": outputs}] * per}
    else:
        fields = {"items": [{"task": 1, "ok": True, "outputs": outputs}] * per}
    return msgpack.packb({"v": PROTOCOL_VERSION, "t": kind, **fields})


@pytest.mark.parametrize("kind", [Msg.STREAMS, Msg.DONE])
def test_a_million_objects_nested_under_the_array_limit_are_refused_before_the_whole_is_built(
        kind):
    header = _nested(kind, 1_000_000)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with pytest.raises(ProtocolError, match="more than 2097152 objects"):
        decode([header])
    seconds = time.perf_counter() - start
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print({"bytes": len(header), "seconds": seconds, "peak_mib": grown / 1024})
    assert seconds < 2
    assert grown < 256 * 1024  # KiB: the objects built before the count ran out


def test_the_largest_done_an_executor_sends_still_decodes():
    """MAX_ITEMS completions as executors/process.py describes them, a small value each."""
    items = [{"task": i, "ok": True, "start": 0.0, "end": 1.0, "report_key": None,
              "trace_key": None, "streamed": 0,
              "outputs": [{"id": i, "nbytes": 0, "inline": b"\x01"}]} for i in range(MAX_ITEMS)]
    header, _ = decode(_done(items))
    assert len(header["items"]) == MAX_ITEMS
