"""Connection liveness decided by libzmq, not by a Python thread [Note: liveness].

[Note: liveness] Whether a peer is still there is a question for libzmq's IO thread, which
needs no GIL and answers ZMTP PINGs however busy the Python threads of its process are: every
socket between the controller and its executors sends a PING after ZMTP_IVL_S of silence
and closes the connection when nothing at all arrives within ZMTP_TIMEOUT_S. A connection
that is closed, by that timeout or because the process at the other end is gone (the kernel
closes its sockets), is a DISCONNECTED event on the socket's monitor, which `ConnectionWatch`
reads. The executor exits when its control connection closes; the controller declares an
executor lost when its heartbeat connection closes. The Python heartbeats remain only to find
processes that are alive but hung, with a timeout of 30 s or more (a starved Python thread is
not a hung process), and local executors die with their parent (PR_SET_PDEATHSIG,
flowkit/runtime/launch.py).
"""

from __future__ import annotations

import os

import zmq
from zmq.utils.monitor import parse_monitor_message

__all__ = ["ZMTP_IVL_S", "ZMTP_TIMEOUT_S", "ConnectionWatch", "zmtp_heartbeats",
           "zmtp_timeout_s"]

# A PING after this much silence on a connection; no traffic at all for ZMTP_TIMEOUT_S closes
# it. A process whose IO thread is not scheduled for 20 s is as good as gone; a busy one
# answers within milliseconds even with its Python threads starved (the IO thread is native).
ZMTP_IVL_S = 2.0
ZMTP_TIMEOUT_S = 20.0


def zmtp_timeout_s() -> float:
    """ZMTP_TIMEOUT_S, or FLOWKIT_ZMTP_TIMEOUT_S of this process's environment (executors
    inherit it; read at each call, as a fork server's children get their environment late)."""
    return float(os.environ.get("FLOWKIT_ZMTP_TIMEOUT_S", ZMTP_TIMEOUT_S))


def zmtp_heartbeats(sock: zmq.Socket, *, interval: float = ZMTP_IVL_S,
                    timeout: float | None = None) -> None:
    """Have libzmq keep `sock`'s connections alive and close those whose peer went silent.
    Set before bind/connect: options apply to the connections made afterwards."""
    timeout = zmtp_timeout_s() if timeout is None else timeout
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(interval * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(timeout * 1000))
    # the peer's timeout for us, should it send no PINGs of its own
    sock.setsockopt(zmq.HEARTBEAT_TTL, int(timeout * 1000))


_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


class ConnectionWatch:
    """The connections of one socket coming and going, read from its monitor: `changes()`
    returns, in order, (opened, fd) for each connection made (True) or closed (False) since
    the last call. Read it from one thread; poll `socket` to wait for a change."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.socket = sock.get_monitor_socket(_EVENTS)

    def changes(self) -> list[tuple[bool, int]]:
        found = []
        while self.socket.poll(0):
            event = parse_monitor_message(self.socket.recv_multipart())
            found.append((event["event"] != zmq.EVENT_DISCONNECTED, int(event["value"])))
        return found

    def close(self) -> None:
        # the watched socket's end of the monitor goes with that socket: disabling it here
        # would touch the socket from this (another) thread
        self.socket.close(linger=0)
