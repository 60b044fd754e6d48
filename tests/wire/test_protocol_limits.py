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
