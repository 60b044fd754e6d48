"""Codec benchmark: a step's records through flowkit's wire codec (flowkit/wire/serialize.py)
against plain msgpack, in one process, side by side in the same run.

Method: `records` Experience records as a GRPO step trains on (10 prompt and 32 response tokens,
four per-token float columns), one list as one body, packed and unpacked `rounds` times each way;
medians in µs a record:

- `flowkit`: `pack` / `unpack` as shipped: records inline, the cycle collector paused while a
  large body decodes ([Note: records inline], [Note: no collections while decoding]);
- `collector_on`: the same bodies decoded with the collector left running (what decoding cost
  before the pause);
- `nested`: the records in the form senders wrote before, each an extension holding its own
  msgpack body (still read): packed by bare msgpack a record at a time as that encoder did,
  decoded as shipped;
- `plain`: the same fields as plain maps through bare msgpack (no records rebuilt, nothing
  checked): the lower bound for moving them, with the collector running as any program's is.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgpack

__all__ = ["run_codec_bench"]

RESPONSE, PROMPT = 32, 10


def run_codec_bench(*, records: int = 4096, rounds: int = 7) -> dict:
    """µs a record to pack and unpack `records` records, each way above."""
    from flowkit.wire import serialize

    if records < 1 or rounds < 1:
        raise ValueError(f"needs records >= 1 and rounds >= 1, got {records} and {rounds}")
    values = _experiences(records)
    body, frames = serialize.pack(values)
    nested = msgpack.packb([_nested(r) for r in values])
    plain = [_fields(r) for r in values]
    plain_body = msgpack.packb(plain)
    assert serialize.unpack(nested, []) == values == serialize.unpack(body, frames)

    def with_collector() -> Any:
        limit, serialize._PAUSE_GC_BYTES = serialize._PAUSE_GC_BYTES, len(body) + 1
        try:
            return serialize.unpack(body, frames)
        finally:
            serialize._PAUSE_GC_BYTES = limit

    per_record = lambda fn: _median_s(fn, rounds) / records * 1e6  # noqa: E731
    figures = {
        "records": records, "bytes_per_record": len(body) / records,
        "flowkit": {"pack_us": per_record(lambda: serialize.pack(values)),
                    "unpack_us": per_record(lambda: serialize.unpack(body, frames))},
        "collector_on": {"unpack_us": per_record(with_collector)},
        "nested": {"pack_us": per_record(lambda: msgpack.packb([_nested(r) for r in values])),
                   "unpack_us": per_record(lambda: serialize.unpack(nested, []))},
        "plain": {"pack_us": per_record(lambda: msgpack.packb(plain)),
                  "unpack_us": per_record(lambda: msgpack.unpackb(plain_body))},
    }
    for way in ("collector_on", "nested", "plain"):
        figures[f"unpack_flowkit_over_{way}"] = (figures["flowkit"]["unpack_us"]
                                                 / figures[way]["unpack_us"])
    for way in ("nested", "plain"):
        figures[f"pack_flowkit_over_{way}"] = (figures["flowkit"]["pack_us"]
                                               / figures[way]["pack_us"])
    return figures


def _experiences(count: int) -> list:
    from flowkit.ops.records import Experience

    floats = [-0.5 - k / 64 for k in range(RESPONSE)]
    return [Experience(prompt_id=i // 8, sample=i % 8, prompt_tokens=list(range(PROMPT)),
                       response_tokens=list(range(RESPONSE)), logprobs=list(floats),
                       versions=[0] * RESPONSE, finished=True, reward=1.0,
                       advantages=list(floats), ref_logprobs=list(floats))
            for i in range(count)]


def _fields(record: Any) -> dict:
    import attrs

    return attrs.asdict(record, recurse=False)


def _nested(record: Any) -> msgpack.ExtType:
    cls = type(record)
    return msgpack.ExtType(3, msgpack.packb([f"{cls.__module__}:{cls.__qualname__}",
                                             _fields(record)]))


def _median_s(fn: Callable[[], Any], rounds: int) -> float:
    """Median seconds of `fn`, each round's result kept while the next runs, as an executor's
    store holds a step's records while more arrive (the collector's work grows with what is
    held)."""
    gc.collect()
    held = fn()  # warm: the record classes' layouts, the allocator
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
        held = result  # noqa: F841 (held until the next round's result replaces it)
    return statistics.median(times)
