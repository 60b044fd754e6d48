"""What a socket takes in, bounded [Note: bounds].

[Note: bounds] Everything that arrives is bounded before Python sees it, by libzmq. A frame
larger than the socket's limit closes the connection that sent it (ZMQ_MAXMSGSIZE): the control
plane's CONTROL_FRAME_BYTES (`flowkit run --max-frame-mib`, told to executors in WELCOME, so an
executor answers a FETCH of a bigger value with an error, never with a frame that would cost it
its connection), the data plane's DATA_FRAME_BYTES (tensors go in 1 MiB chunks between hosts).
Each inbound connection at the controller and at a data socket queues at most `RCVHWM` messages;
past that libzmq stops reading it (TCP pushes back on that sender alone) and nothing is dropped.
An executor's control socket, reached only by the controller, has none. Outbound, the ROUTERs
queue at most `SNDHWM` messages a connection: the controller refuses past it and loses the
executor that does not read ([Note: a full send queue] in runtime/controller.py); a data socket
sends nothing. Strangers get no replies at all ([Note: refusals] in wire/refusals.py).
Peer strings are escaped and truncated (schema.py `shown`), a HELLO's lists capped (hello.py),
unclaimed objects capped per executor ([Note: unclaimed objects in executors/store.py]).
The table of bounds and how to change them: docs/security.md, "Bounds".
"""

from __future__ import annotations

import zmq

__all__ = ["CONTROL_FRAME_BYTES", "CONTROL_RCVHWM", "CONTROL_SNDHWM", "DATA_FRAME_BYTES",
           "DATA_RCVHWM", "DATA_SNDHWM", "UNCLAIMED_BYTES", "bound_inbound"]

MiB = 1 << 20
CONTROL_FRAME_BYTES = 256 * MiB
DATA_FRAME_BYTES = 256 * MiB
CONTROL_RCVHWM = 10_000  # messages a connection may have queued: completions are small
DATA_RCVHWM = 1_000
# messages queued to one connection: a live executor's libzmq reads as fast as the controller
# writes, so only a peer that does not read ever fills it
CONTROL_SNDHWM = 100_000
DATA_SNDHWM = 16  # a data socket answers nothing: no queue of replies may grow there
# objects a peer pushed that no task on the executor waits for yet (executors/store.py)
UNCLAIMED_BYTES = 4 << 30


def bound_inbound(sock: zmq.Socket, *, max_frame: int, rcvhwm: int) -> None:
    """Set `sock`'s inbound bounds; before bind/connect, as they apply to new connections."""
    sock.setsockopt(zmq.MAXMSGSIZE, int(max_frame))
    sock.setsockopt(zmq.RCVHWM, int(rcvhwm))
