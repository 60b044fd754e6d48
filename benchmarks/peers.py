"""Bare pyzmq peers, the baselines of the dispatch and transfer benchmarks, each a process of its
own so it can run on another host (`Host.prefix`, flowkit/runtime/netns.py):

    python -m benchmarks.peers echo CONTROLLER   msgpack echo, as an executor answers no-ops
    python -m benchmarks.peers sink HOST         takes byte messages, acks each; prints its port
    python -m benchmarks.peers source BENCH SINK sends the bytes the bench asks for to the sink

Plain Python loops, as executors are, so both sides of a comparison pay for Python. Each takes a
keys folder as its last argument to speak CurveZMQ, with the roles flowkit's sockets have
[Note: authenticated transport in flowkit/wire/auth.py]: the bench as the controller, the
peers as executors.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgpack
import zmq

if TYPE_CHECKING:
    from flowkit.wire.auth import Keys

__all__ = ["curve", "curve_keys", "spawn"]

CHUNK_BYTES = 1 << 20  # as the executors' frames to another host (wire/shm.py)


def spawn(role: str, *args: str, prefix: Sequence[str] = ()) -> subprocess.Popen:
    """Start a peer (on the host `prefix` runs commands on); its stdout is a pipe."""
    return subprocess.Popen([*prefix, sys.executable, "-m", "benchmarks.peers", role, *args],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)


def _unbounded(sock: zmq.Socket) -> zmq.Socket:
    # as the controller's ROUTER: past its high-water mark a ROUTER drops messages silently
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


@contextlib.contextmanager
def curve_keys(enabled: bool) -> Iterator[Keys | None]:
    """A fresh keys folder for one bench run (`--curve`), removed after; None when not."""
    if not enabled:
        yield None
        return
    from flowkit.wire.auth import generate_keys

    with tempfile.TemporaryDirectory(prefix="flowkit-bench-keys-") as folder:
        yield generate_keys(Path(folder) / "keys")


def curve(sock: zmq.Socket, keys: str, *, serve: str = "", of: str = "") -> zmq.Socket:
    """With a keys folder, make `sock` a CURVE server with the pair of role `serve`, or a
    client (the executor pair) of a server of role `of`; without, leave it plain."""
    if keys:
        from flowkit.wire.auth import Keys, curve_client, curve_server

        loaded = Keys.load(keys)
        if serve:
            curve_server(sock, loaded, serve)
        else:
            curve_client(sock, loaded, of)
    return sock


def echo(address: str, keys: str = "") -> None:
    context = zmq.Context()
    sock = curve(_unbounded(context.socket(zmq.ROUTER)), keys, of="controller")
    sock.connect(address)
    while True:
        identity, body = sock.recv_multipart()
        message = msgpack.unpackb(body)
        if message.get("t") == "stop":
            break
        sock.send_multipart([identity, msgpack.packb({"t": "done", "id": message["id"]})])
    sock.close()
    context.term()


def batch(address: str, keys: str = "") -> None:
    """A stage that takes a batch of records (a msgpack list) and answers with them, decoded
    and encoded again: one call per stage, the way a Ray-style controller moves a batch."""
    context = zmq.Context()
    sock = curve(_unbounded(context.socket(zmq.ROUTER)), keys, of="controller")
    sock.connect(address)
    while True:
        identity, body = sock.recv_multipart()
        if body == b"stop":
            break
        sock.send_multipart([identity, msgpack.packb(msgpack.unpackb(body))])
    sock.close()
    context.term()


def sink(host: str, keys: str = "") -> None:
    context = zmq.Context()
    sock = curve(_unbounded(context.socket(zmq.ROUTER)), keys, serve="executor")
    port = sock.bind_to_random_port(f"tcp://{host}")
    print(port, flush=True)
    while True:
        identity, *frames = sock.recv_multipart(copy=False)
        if len(frames) == 1 and frames[0].bytes == b"stop":
            break
        sock.send_multipart([identity, b"ok"])
        del frames
    sock.close()
    context.term()


def source(bench: str, sink_address: str, keys: str = "") -> None:
    context = zmq.Context()
    control = curve(_unbounded(context.socket(zmq.DEALER)), keys, of="controller")
    control.connect(bench)
    data = curve(_unbounded(context.socket(zmq.DEALER)), keys, of="executor")
    data.connect(sink_address)
    payload = memoryview(b"")
    control.send(b"ready")
    while True:
        request = msgpack.unpackb(control.recv())
        if request["t"] == "stop":
            data.send(b"stop")
            break
        nbytes = request["nbytes"]
        if payload.nbytes != nbytes:  # written once: no page faults in the timed rounds
            payload = memoryview(bytearray(b"\x01" * nbytes))
        chunks = [payload[i:i + CHUNK_BYTES] for i in range(0, nbytes, CHUNK_BYTES)]
        data.send_multipart(chunks, copy=False)
        data.recv()
        control.send(b"done")
    data.close(linger=1000)
    control.close()
    context.term()


def main(argv: Sequence[str]) -> None:
    roles = {"echo": echo, "batch": batch, "sink": sink, "source": source}
    if not argv or argv[0] not in roles:
        raise SystemExit(f"usage: python -m benchmarks.peers {'|'.join(roles)} ARGS")
    roles[argv[0]](*argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
