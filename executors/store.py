"""The executor's object store: the values its tasks made and those sent to it, by object id,
until the controller frees them; the packed bodies of the small ones (executors/outbox.py
`packed`), and the objects peers pushed before any task here asked for them."""

from __future__ import annotations

from typing import Any

from flowkit.wire.limits import UNCLAIMED_BYTES
from flowkit.wire.protocol import ProtocolError

__all__ = ["ObjectStore"]


class ObjectStore:
    """What an executor holds: `objects` by id, `bodies` (small objects packed, kept for
    whichever of describing and pushing comes second) and the unclaimed ones' sizes."""

    def __init__(self) -> None:
        self.objects: dict[int, Any] = {}
        self.bodies: dict[int, bytes] = {}  # small objects packed (executors/outbox.py packed)
        self.unclaimed: dict[int, int] = {}  # [Note: unclaimed objects]: id -> bytes
        self.unclaimed_bytes = 0

    def hold_unclaimed(self, object_id: int, nbytes: int) -> None:
        """[Note: unclaimed objects] A peer may push an object before the task that reads it
        reaches this executor (the producer's SEND and this executor's RUN travel apart), so
        an object no task waits for yet is kept, but only up to UNCLAIMED_BYTES of them: a
        peer cannot fill this process with objects nobody asked for. A RUN that reads it
        claims it; a FREE drops it."""
        held = self.unclaimed_bytes + nbytes
        if held > UNCLAIMED_BYTES:
            raise ProtocolError(f"data: object {object_id} ({nbytes} bytes) is not awaited "
                                f"here, and {self.unclaimed_bytes} bytes of such objects are "
                                f"held already (at most {UNCLAIMED_BYTES})")
        self.unclaimed[object_id] = nbytes
        self.unclaimed_bytes = held

    def claim(self, object_id: int) -> None:
        nbytes = self.unclaimed.pop(object_id, None)
        if nbytes is not None:
            self.unclaimed_bytes -= nbytes

    def free(self, object_id: int) -> None:
        self.objects.pop(object_id, None)
        self.bodies.pop(object_id, None)
        if self.unclaimed:
            self.claim(object_id)
