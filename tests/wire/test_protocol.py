import msgpack
import pytest

from flowkit.wire.protocol import PROTOCOL_VERSION, Msg, ProtocolError, decode, encode


def test_round_trip_keeps_fields_and_frames():
    parts = encode(Msg.RUN, {"tasks": [{"id": 1, "op": "noop", "config": {}, "inputs": [],
                                        "outputs": [2]}]}, [b"raw"])
    header, frames = decode(parts)
    assert header["v"] == PROTOCOL_VERSION and header["t"] == Msg.RUN
    assert header["tasks"][0]["op"] == "noop"
    assert frames == [b"raw"]


@pytest.mark.parametrize(
    ("parts", "reason"),
    [
        ([], "empty message"),
        ([b"\xc1garbage"], "not msgpack"),
        ([msgpack.packb([1, 2])], "must be a map"),
        ([msgpack.packb({"v": 99, "t": "run", "tasks": []})], "version 99 is not supported"),
        ([msgpack.packb({"t": "run", "tasks": []})], "version None"),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "t": "explode"})], "unknown message type"),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "t": "run"})], "missing field 'tasks'"),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "t": "run", "tasks": "x"})], "must be list"),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "t": "run", "tasks": [{"id": 1}]})],
         "missing field 'op'"),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "t": "free", "objects": True})], "must be list"),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "t": "fetch", "object": True, "request": 1})],
         "must be int"),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "t": "objects", "objects": []})],
         "carries at least one"),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "t": "objects", "objects": [7]})],
         "an object must be a map"),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "t": "objects",
                         "objects": [{"object": 1, "body": b"\xc0"}, {"object": 2}]})],
         "missing field 'body'"),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "t": "objects",
                         "objects": [{"object": "1", "body": b"\xc0"}]})], "must be int"),
    ],
)
def test_malformed_messages_say_what_is_wrong(parts, reason):
    with pytest.raises(ProtocolError, match=reason):
        decode(parts)
