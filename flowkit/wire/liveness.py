"""Connection liveness decided by libzmq, not by a Python thread [Note: liveness].

[Note: liveness] Whether a peer is still there is a question for libzmq's IO thread, which
needs no GIL and answers ZMTP PINGs however busy the Python threads of its process are: every
executor's socket, and the controller's heartbeat socket, sends a PING every ZMTP_IVL_S and
closes the connection when nothing at all arrives within ZMTP_TIMEOUT_S. The servers that take
bulk traffic (the controller's ROUTER, an executor's data socket) send none, and close a
connection whose peer's PINGs stop (their TTL) or whose handshake takes ZMTP_TIMEOUT_S: libzmq
4.3.5 aborts a process that PINGs where a full queue closed [Note: strangers stop at the
handshake in flowkit/wire/auth.py]. A connection that is closed, by that timeout or because the
process at the other end is gone (the kernel closes its sockets), is a DISCONNECTED event on
the socket's monitor, which `ConnectionWatch` reads. The executor exits when its control
connection closes; the controller declares an executor lost when its heartbeat connection
closes. The Python heartbeats remain only to find processes that are alive but hung, with a
timeout of 30 s or more (a starved Python thread is not a hung process), and local executors
die with their parent (PR_SET_PDEATHSIG, flowkit/runtime/launch.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

__all__ = ["ZMTP_IVL_S", "ZMTP_TIMEOUT_S", "ConnectionWatch", "zmtp_heartbeats",
           "zmtp_quiet_server", "zmtp_timeout_s"]

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


def zmtp_quiet_server(sock: zmq.Socket) -> None:
    """A server socket that sends no PINGs of its own [Note: liveness]: it answers its peers'
    PINGs and closes a connection when their TTL passes without one, and drops a connection
    whose handshake is not done within the timeout (a silent partial frame in it is freed)."""
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(zmtp_timeout_s() * 1000))


_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


class ConnectionWatch:
    """The connections of one socket coming and going, read from its monitor: `changes()`
    returns, in order, (opened, fd) for each connection made (True) or closed (False) since
    the last call, and hands each failed handshake's event to `on_failed`, where given (a
    socket has one monitor: the gate's, or this). Read it from one thread; poll `socket` to
    wait for a change."""

    def __init__(self, sock: zmq.Socket, on_failed: Callable[[dict], None] | None = None
                 ) -> None:
        self.on_failed = on_failed
        self.socket = sock.get_monitor_socket(_EVENTS | (_FAILED if on_failed else 0))

    def changes(self) -> list[tuple[bool, int]]:
        found = []
        while self.socket.poll(0):
            event = parse_monitor_message(self.socket.recv_multipart())
            if event["event"] & _FAILED:
                self.on_failed(event)
            else:
                found.append((event["event"] != zmq.EVENT_DISCONNECTED, int(event["value"])))
        return found

    def close(self) -> None:
        # the watched socket's end of the monitor goes with that socket: disabling it here
        # would touch the socket from this (another) thread
        self.socket.close(linger=0)
