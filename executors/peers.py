"""The executor's pushes to its peers: an object the controller says to SEND goes, once it
exists, straight to the executor that consumes it; small plain ones wait in the outbox and go
many to a message [Note: objects in batches in executors/outbox.py], the rest go alone as DATA,
through shared memory to a peer on this host and in chunks to others (flowkit/wire/shm.py).
With a run secret, every message to a peer carries the run's tag, and what a peer pushes here
must carry it too [Note: joining a run in flowkit/wire/hello.py]."""

from __future__ import annotations

import hmac
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import zmq

from executors.outbox import BATCH_BYTES, Outbox, packed
from executors.store import ObjectStore
from flowkit.wire.auth import EXECUTOR
from flowkit.wire.protocol import Msg, ProtocolError, encode

__all__ = ["Peers"]


class Peers:
    """One executor's side of the data plane: a DEALER to each peer it pushed to (made with
    `client_socket`), the pushes waiting for their object, and the outbox."""

    def __init__(self, store: ObjectStore, client_socket: Callable[[str], zmq.Socket], *,
                 host_id: str, tag: str | None, cleanup_hooks: list) -> None:
        self.store = store
        self.client_socket = client_socket  # Executor.client_socket: keys, frame bounds
        self.host_id = host_id
        self.tag = tag  # what this executor's DATA carries, and what a peer's must
        self.cleanup_hooks = cleanup_hooks  # the executor's, run before it exits
        # object id -> (peer address, peer host id) to push it to once it exists
        self.waiting: dict[int, list[tuple[str, str]]] = defaultdict(list)
        self.sockets: dict[str, zmq.Socket] = {}
        self.outbox = Outbox()  # small objects for peers [Note: objects in batches]
        self._transport: Any = None  # the PeerTransport, made on first use

    def send(self, object_id: int, address: str, host_id: str) -> None:
        """Push the object now if it is here, else once it is (`stored`)."""
        if object_id in self.store.objects:
            self.push(object_id, address, host_id)
        else:
            self.waiting[object_id].append((address, host_id))

    def stored(self, object_id: int) -> None:
        """The object is here now: push it to the peers waiting for it."""
        for address, host_id in self.waiting.pop(object_id, ()):
            self.push(object_id, address, host_id)

    def forget(self, object_id: int) -> None:
        self.waiting.pop(object_id, None)

    def push(self, object_id: int, address: str, host_id: str) -> None:
        store = self.store
        body, frames = packed(object_id, store.objects[object_id], store.bodies)
        if not frames and len(body) <= BATCH_BYTES:  # goes with others [Note: objects in batches]
            self.outbox.add((address, host_id), object_id, body)
            return
        meta, wire = self.transport().encode(body, frames, host_id)
        frames.clear()  # pack's closure cycle holds the list: see Executor._take
        self._send(address, Msg.DATA, {"object": object_id, "meta": meta}, wire)

    def flush(self) -> None:
        """The small objects waiting for peers, each peer's in OBJECTS messages."""
        for (address, _), batches in self.outbox.take().items():
            for batch in batches:
                objects = [{"object": object_id, "body": body} for object_id, body in batch]
                self._send(address, Msg.OBJECTS, {"objects": objects})

    def _send(self, address: str, kind: str, header: dict, frames: list = ()) -> None:
        sock = self.sockets.get(address)
        if sock is None:
            sock = self.sockets[address] = self.client_socket(EXECUTOR)
            sock.connect(address)
        if self.tag is not None:
            header["auth"] = self.tag
        # zero-copy pays for a value's frames, not for a batch of small objects (Executor._send)
        sock.send_multipart(encode(kind, header, frames), copy=kind != Msg.OBJECTS)

    def transport(self) -> Any:
        """Shared memory to peers on this host, chunked frames to others (wire/shm.py)."""
        if self._transport is None:
            from flowkit.wire.shm import PeerTransport

            self._transport = PeerTransport(host=self.host_id)
            # close() and the heartbeat's exit run the hooks: the segments' names go with us
            self.cleanup_hooks.append(self._transport.unlink_all)
        return self._transport

    def check(self, header: dict) -> None:
        """What a peer pushed here carries this run's tag (none is asked without a secret)."""
        if self.tag is not None and not (
                type(header.get("auth")) is str and
                hmac.compare_digest(header["auth"], self.tag)):
            raise ProtocolError(f"{header['t']}: not from a peer of this run (its run tag is "
                                "missing or wrong); refused")

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close(linger=0)
