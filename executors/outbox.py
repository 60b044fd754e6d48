"""Small objects on their way to peer executors, sent many to a message.

[Note: objects in batches] A sample's records are small (a few hundred bytes), and a GRPO step
moves each several times between executors (a rollout to its scorer, a score to the advantage's
executor, an experience to the trainer). One DATA message an object cost more than the object:
its own pack of a header, a send, zmq's IO threads on both sides and a receive, about five
pushes a sample in the scale bench. So an object whose value is plain data (no tensor frames)
and at most BATCH_BYTES waits here, by peer, until the executor next tells the controller what
it finished (`Executor._flush_completions` and `send_parts`, which run after every task, every
millisecond of a burst of tasks and every decoding iteration, and by the watch while an op runs
long): then each peer's objects go as OBJECTS messages of at most BATCH_BYTES of bodies. Tensors
and big values go at once, alone, as DATA (shared memory or chunks: flowkit/wire/shm.py).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from flowkit.wire.serialize import pack

__all__ = ["BATCH_BYTES", "Outbox", "packed"]

BATCH_BYTES = 1 << 20  # bodies in one OBJECTS message: far below any frame limit

Target = tuple[str, str]  # (peer address, peer host id)


class Outbox:
    """Plain objects waiting for a peer, in the order they were pushed."""

    def __init__(self) -> None:
        self.batches: dict[Target, list[list[tuple[int, bytes]]]] = defaultdict(list)
        self.sizes: dict[Target, int] = defaultdict(int)  # bytes in each target's last batch

    def __bool__(self) -> bool:
        return bool(self.batches)

    def add(self, target: Target, object_id: int, body: bytes) -> None:
        batches = self.batches[target]
        if not batches or self.sizes[target] + len(body) > BATCH_BYTES:
            batches.append([])
            self.sizes[target] = 0
        batches[-1].append((object_id, body))
        self.sizes[target] += len(body)

    def take(self) -> dict[Target, list[list[tuple[int, bytes]]]]:
        """Every waiting batch, by target; the outbox is empty after."""
        batches = self.batches
        self.batches, self.sizes = defaultdict(list), defaultdict(int)
        return batches


def packed(object_id: int, value: Any, bodies: dict[int, bytes] | None) -> tuple[bytes, list]:
    """`pack(value)`, once an object: an executor describes each output to the controller by
    its packed size and pushes it to its consumers, and a small plain body (what batches here)
    is kept in `bodies` (its object's, dropped when it is freed) for whichever comes second.
    A value with tensor frames is packed each time: keeping its frames would keep a host copy
    of a GPU tensor alive."""
    body = bodies.get(object_id) if bodies is not None else None
    if body is not None:
        return body, []
    body, frames = pack(value)
    if bodies is not None and not frames and len(body) <= BATCH_BYTES:
        bodies[object_id] = body
    return body, frames
