"""The wire protocol between controller and executors, and between executors.

A message is a list of zmq frames: one msgpack header (a map), then raw frames for tensor bytes.
Every header carries the protocol version `v` and a message type `t`; everything else depends on
the type and is checked by `decode` against a small schema, so a malformed message becomes a
ProtocolError that the receiver answers with an ERROR reply instead of crashing. No pickle. A RUN
message's tasks are TaskSpecs (task.py), which `decode` decodes and checks too.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq

from flowkit.wire.schema import ProtocolError, Schema, check_fields
from flowkit.wire.task import decode_tasks

__all__ = ["PROTOCOL_VERSION", "ProtocolError", "Msg", "check_completion", "decode", "encode",
           "part_id", "send_frames"]

# 2: streamed results (PART); 3: batched tasks and their early items (ITEMS); 4: several
# streaming tasks' items in one message (STREAMS); 5: several small objects to a peer in one
# message (OBJECTS)
PROTOCOL_VERSION = 5


class Msg:
    """Message types. Controller -> executor: WELCOME RUN SEND FREE FETCH PUT CANCEL CREDIT
    SHUTDOWN PING. Executor -> controller: HELLO PART PARTS STREAMS ITEMS DONE VALUE PONG
    ERROR.
    Executor -> executor: DATA OBJECTS."""

    HELLO = "hello"  # who I am: name, tags, device, ops, peer addresses
    WELCOME = "welcome"  # your executor id, heartbeat settings
    PING = "ping"  # heartbeat, both ways
    RUN = "run"  # a batch of tasks: op, config, input and output object ids
    PART = "part"  # one item a streaming task yielded, before the task is done
    PARTS = "parts"  # several items a streaming task yielded, in one message
    STREAMS = "streams"  # the items several streaming tasks yielded: a PARTS body for each
    ITEMS = "items"  # the items a batched task has finished, while it runs on
    DONE = "done"  # a batch of completions (or failures) with timings
    SEND = "send"  # push these objects to a peer executor once each exists
    DATA = "data"  # an object arriving from a peer
    OBJECTS = "objects"  # several small objects from a peer [Note: objects in batches]
    PUT = "put"  # an object from the controller (user data)
    FETCH = "fetch"  # send me the value of an object
    VALUE = "value"  # the reply to FETCH
    FREE = "free"  # drop these objects
    CANCEL = "cancel"  # drop these tasks: an input failed upstream
    CREDIT = "credit"  # a streaming task may run this many items on [Note: stream credits]
    ERROR = "error"  # your message was malformed; here is why
    SHUTDOWN = "shutdown"


# type -> required fields and their Python types. Extra fields are allowed (forward compatible).
_SCHEMA: dict[str, Schema] = {
    Msg.HELLO: {"name": str, "tags": list, "ops": list, "pid": int},
    Msg.WELCOME: {"executor": int, "ping_interval": (int, float), "ping_timeout": (int, float)},
    Msg.PING: {},
    Msg.RUN: {"tasks": list},
    Msg.PART: {"task": int, "index": int, "end": (int, float), "output": dict},
    Msg.PARTS: {"task": int, "index": int, "end": (int, float), "outputs": list},
    Msg.STREAMS: {"end": (int, float), "tasks": list},
    Msg.ITEMS: {"task": int, "first": int, "end": (int, float), "outputs": list},
    Msg.DONE: {"items": list},
    Msg.SEND: {"objects": list, "to": int, "address": str},
    Msg.DATA: {"object": int, "meta": dict},
    Msg.OBJECTS: {"objects": list},
    Msg.PUT: {"object": int, "meta": dict},
    Msg.FETCH: {"object": int, "request": int},
    Msg.VALUE: {"request": int, "meta": dict},
    Msg.FREE: {"objects": list},
    Msg.CANCEL: {"tasks": list},
    Msg.CREDIT: {"task": int, "credited": int},
    Msg.ERROR: {"reason": str},
    Msg.SHUTDOWN: {},
}

# An output as an executor describes it (executors/tasks.py summarize_output): its object id, and as
# the case may be its size, its value inline, its length, its items' keys and traced values.
_OUTPUT_FIELDS: dict[str, tuple[type, ...]] = {
    "id": (int,), "nbytes": (int,), "inline": (bytes,), "count": (int,), "keys": (list,),
    "trace": (list,)}
_TIMES = (int, float)


# One packer for all messages (packb builds one, buffer and all, per call); locked, as a dict
# subclass in a header (a config) makes msgpack call back into Python, where threads switch.
_PACKER, _PACKING = msgpack.Packer(use_bin_type=True), threading.Lock()


def encode(kind: str, fields: dict[str, Any] | None = None, frames: Sequence = ()) -> list:
    """Frames of one message: the msgpack header, then the raw frames."""
    header = {"v": PROTOCOL_VERSION, "t": kind}
    if fields:
        header.update(fields)
    with _PACKING:
        return [_PACKER.pack(header), *frames]


# [Note: header limits] A header's arrays and maps are refused past twice the most items a
# message carries (a batched task's MAX_ITEMS in flowkit/wire/task.py) as msgpack reads their
# lengths, before it allocates them: an insider's DONE of 10^6 items costs the controller a
# ProtocolError, not 600 MB (tests/wire/test_protocol_limits.py).
_HEADER_LIMITS = {"max_array_len": 1 << 17, "max_map_len": 1 << 17}
# [Note: header totals] Those limits bound one array, not a message: a STREAMS of 8 bodies of
# 131,072 outputs each, or a DONE of 8 completions of as many, is 10^6 objects all the same. A
# header over COUNTED_ABOVE bytes (a usual one is well under) is decoded with hooks that count
# every array and map and their items as msgpack finishes each, and refused past
# MAX_HEADER_OBJECTS, well before the whole is built (the most a legit DONE of MAX_ITEMS
# completions holds is about 10^6); smaller headers cannot inflate far and skip the count.
COUNTED_ABOVE = 64 << 10
MAX_HEADER_OBJECTS = 1 << 21


class _TooMany(Exception):
    pass


def _unpack_counted(raw: bytes) -> Any:
    left = MAX_HEADER_OBJECTS

    def count(container: Any) -> Any:
        nonlocal left
        left -= 1 + len(container)
        if left < 0:
            raise _TooMany
        return container

    return msgpack.unpackb(raw, raw=False, strict_map_key=False, list_hook=count,
                           object_hook=count, **_HEADER_LIMITS)


def decode(parts: Sequence) -> tuple[dict[str, Any], list]:
    """(header, raw frames) of a received message, or ProtocolError saying what is wrong. A RUN
    header gains `specs`: its `tasks` decoded, each a TaskSpec or, where malformed, a
    RejectedTask [Note: a task on the wire in flowkit/wire/task.py]."""
    if not parts:
        raise ProtocolError("empty message")
    first = parts[0]
    raw = first if type(first) is bytes else getattr(first, "bytes", first)  # a zmq.Frame
    try:
        if len(raw) <= COUNTED_ABOVE:
            header = msgpack.unpackb(raw, raw=False, strict_map_key=False, **_HEADER_LIMITS)
        else:  # [Note: header totals]
            header = _unpack_counted(raw)
    except _TooMany:
        raise ProtocolError(f"header holds more than {MAX_HEADER_OBJECTS} objects "
                            f"({len(raw)} bytes)") from None
    except Exception as exc:  # msgpack raises several types for garbage, and past a limit
        raise ProtocolError(f"header is not msgpack: {exc.__class__.__name__}: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a map, got {type(header).__name__}")
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version!r} is not supported (this side speaks {PROTOCOL_VERSION})"
        )
    kind = header.get("t")
    schema = _SCHEMA.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ProtocolError(f"unknown message type {kind!r}")
    check_fields(kind, header, schema)
    if kind in (Msg.PART, Msg.PARTS, Msg.ITEMS) and type(header.get("start", 0.0)) not in (
            int, float):
        raise ProtocolError(f"{kind}: field 'start' must be a time, got "
                            f"{header['start']!r:.80}")
    if kind == Msg.RUN:
        header["specs"] = decode_tasks(header["tasks"])
    elif kind == Msg.PART:
        _check_outputs(kind, [header["output"]])
    elif kind in (Msg.PARTS, Msg.ITEMS):
        if kind == Msg.ITEMS and not header["outputs"]:
            raise ProtocolError("items: a message of early items names at least one")
        _check_outputs(kind, header["outputs"])
    elif kind == Msg.STREAMS:
        _check_streams(header)
    elif kind == Msg.OBJECTS:
        _check_objects(header["objects"])
    return header, list(parts[1:])


_OBJECT_SCHEMA: Schema = {"object": int, "body": bytes}


def _check_objects(objects: list) -> None:
    """Each object of an OBJECTS message a map of an int id and its msgpack body (plain data:
    an object with tensor frames travels alone, as DATA)."""
    if not objects:
        raise ProtocolError("objects: a message of objects carries at least one")
    for entry in objects:
        if type(entry) is not dict:
            raise ProtocolError(f"objects: an object must be a map, got {entry!r:.80}")
        check_fields("objects entry", entry, _OBJECT_SCHEMA)


_STREAM_SCHEMA: Schema = {"task": int, "index": int, "outputs": list}


def _check_streams(header: dict) -> None:
    """Each task's items in a STREAMS message well formed, as a PARTS message's would be; each
    gains the message's `end`, so that it reads as a PARTS body."""
    end = header["end"]
    for body in header["tasks"]:
        if type(body) is not dict:
            raise ProtocolError(f"streams: a task's items must be a map, got {body!r:.80}")
        check_fields("streams task", body, _STREAM_SCHEMA)
        if type(body.get("start", 0.0)) not in _TIMES:
            raise ProtocolError(f"streams: field 'start' must be a time, got "
                                f"{body['start']!r:.80}")
        _check_outputs(Msg.PARTS, body["outputs"])
        body["end"] = end


def _check_outputs(kind: str, outputs: list) -> None:
    """Every described output well formed, before any bookkeeping reads one: a map with an int
    id, whose other known fields have their types (a part's size is required)."""
    for out in outputs:
        if type(out) is not dict or type(out.get("id")) is not int:
            raise ProtocolError(f"{kind}: an output must be a map with an int id, got "
                                f"{out!r:.80}")
        for field, value in out.items():
            expected = _OUTPUT_FIELDS.get(field)
            if expected is not None and type(value) not in expected:
                raise ProtocolError(f"{kind}: an output's nbytes must be an int and its inline "
                                    f"value bytes, its count an int, its keys and trace lists; "
                                    f"got {field} {value!r:.80}")
        if kind in (Msg.PART, Msg.PARTS) and "nbytes" not in out:
            raise ProtocolError(f"part output: missing field 'nbytes' (object {out['id']})")


def check_completion(item: Any) -> None:
    """ProtocolError unless `item` is a well-formed completion of a DONE: a map with an int task,
    a bool ok and times; an ok one's outputs described as _check_outputs asks, a failed one's
    error and traceback text. The controller checks each completion before it counts it
    (flowkit/runtime/dispatch.py `_on_done`: the usual one inline, any other here)."""
    if type(item) is not dict:
        raise ProtocolError(f"done: a completion must be a map, got {item!r:.80}")
    get = item.get
    if type(get("task")) is not int or type(get("ok")) is not bool:
        raise ProtocolError(f"done: a completion must be a map with an int task and a "
                            f"bool ok, got {item!r:.80}")
    if type(get("start", 0.0)) not in _TIMES or type(get("end", 0.0)) not in _TIMES:
        raise ProtocolError(f"done: task {item['task']}'s start and end must be times")
    if not item["ok"]:
        if type(get("error", "")) is not str or type(get("traceback", "")) is not str:
            raise ProtocolError(f"done: task {item['task']}'s error and traceback must be "
                                "text")
        return
    outputs = get("outputs", _NO_OUTPUTS)
    if type(outputs) is not list:
        raise ProtocolError(f"done: task {item['task']}'s outputs must be a list")
    _check_outputs("done", outputs)


_NO_OUTPUTS: list = []


# [Note: part ids] A streaming task's output object is the list of everything it yielded; item
# i of it is also an object of its own, sent the moment it is yielded (PART), whose id both
# sides compute from the output's id: no round trip to name it. Ids the controller hands out
# count up from 1 and stay far below _PART_BASE.
_PART_BASE, _PART_BITS = 1 << 62, 20
MAX_PARTS = 1 << _PART_BITS  # items one streaming task may yield


def part_id(object_id: int, index: int) -> int:
    """The object id of item `index` that the task producing `object_id` streamed."""
    if not 0 <= index < MAX_PARTS:
        raise ProtocolError(f"a streaming task yields at most {MAX_PARTS} items, not {index + 1}")
    return _PART_BASE | (object_id << _PART_BITS) | index


_SNDMORE = int(zmq.SNDMORE)


def send_frames(sock: zmq.Socket, parts: Sequence, *, copy: bool = True, flags: int = 0
                ) -> None:
    """`sock.send_multipart(parts, flags, copy=copy)` without its IntFlag arithmetic on every
    frame, microseconds a message on the dispatch path (`flags`: a plain int)."""
    last, more = len(parts) - 1, _SNDMORE | flags
    for i, part in enumerate(parts):
        sock.send(part, more if i < last else flags, copy=copy)

