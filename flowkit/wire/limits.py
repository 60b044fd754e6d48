"""What a socket takes in, bounded [Note: bounds].

[Note: bounds] Everything that arrives is bounded before Python sees it, by libzmq:

- A frame larger than the socket's `max_frame` closes the connection that sent it
  (ZMQ_MAXMSGSIZE), so one huge frame cannot take a process's memory. The control plane
  (the controller's ROUTERs, an executor's DEALER to it) carries instructions, completions,
  values the user puts or fetches: CONTROL_FRAME_BYTES by default, configurable with
  `Controller(max_frame_bytes=...)` / `flowkit run --max-frame-mib`; the controller tells its
  executors in WELCOME, and an executor answers a FETCH of a bigger value with an error, never
  with a frame that would cost it its connection. The data plane (an executor's peer ROUTER)
  carries tensors in chunks of at most 1 MiB between hosts and shared-memory handles within
  one: DATA_FRAME_BYTES.
- Each connection's inbound queue at the controller and at an executor's data socket holds at
  most `RCVHWM` messages; past that, libzmq stops reading from that connection (TCP pushes
  back on its sender alone) and nothing is dropped. An executor's control socket, which only
  the controller reaches, has none: its queue would only move into the controller's.
  Outbound queues of ROUTERs stay unbounded: a ROUTER drops what exceeds its high-water mark,
  and what the controller sends is bounded by what the user submitted.
- Peer-supplied strings are shown escaped and truncated (flowkit/wire/schema.py `shown`);
  names, tags and ops lists of a HELLO are capped (flowkit/wire/hello.py); objects nobody
  waits for are capped per executor (executors/store.py [Note: unclaimed objects]); a
  streaming task runs at most a window of items ahead of its consumers (flow control in
  flowkit/runner).
"""

from __future__ import annotations

import zmq

__all__ = ["CONTROL_FRAME_BYTES", "CONTROL_RCVHWM", "DATA_FRAME_BYTES", "DATA_RCVHWM",
           "UNCLAIMED_BYTES", "bound_inbound"]

MiB = 1 << 20
CONTROL_FRAME_BYTES = 256 * MiB
DATA_FRAME_BYTES = 256 * MiB
CONTROL_RCVHWM = 10_000  # messages a connection may have queued: completions are small
DATA_RCVHWM = 1_000
# objects a peer pushed that no task on the executor waits for yet (executors/store.py)
UNCLAIMED_BYTES = 4 << 30


def bound_inbound(sock: zmq.Socket, *, max_frame: int, rcvhwm: int) -> None:
    """Set `sock`'s inbound bounds; before bind/connect, as they apply to new connections."""
    sock.setsockopt(zmq.MAXMSGSIZE, int(max_frame))
    sock.setsockopt(zmq.RCVHWM, int(rcvhwm))
