"""The messages between a launcher and its fork server [Note: fork server in
executors/forkserver.py]: one msgpack map per packet of a Unix SOCK_SEQPACKET socket, with the
child's standard streams passed as file descriptors beside a start request.

  launcher -> server   {"hello": FINGERPRINT}
  server -> launcher   {"ok": true} | {"refused": WHY}
  launcher -> server   {"start": {"argv": [...], "env": {...}, "cwd": PATH, "watch": PID}}
                       + 3 fds (stdin, stdout, stderr)
  server -> launcher   {"started": PID} | {"refused": WHY}
  server -> launcher   {"exited": PID, "code": CODE}   (any time after "started")
  anyone -> server     {"children_of": PID}   (after its hello: a test that kills a run's
  server -> anyone     {"children": [PID, ...]}   executors, executor_processes)

Everything received is checked here, on both sides: a peer is another process, and the
server's peer a stranger until its hello matches (besides the socket's owner-only folder and
the peer's uid, checked by the server)."""

from __future__ import annotations

import array
import os
import socket
import struct
import sys
from pathlib import Path
from typing import Any

import msgpack

__all__ = ["MAX_PACKET", "ForkServerError", "check_pid", "check_start", "fingerprint", "peer_pid",
           "peer_uid", "receive", "send"]

MAX_PACKET = 1 << 20  # an environment of a few hundred variables fits many times over
_LIMITS = {"max_str_len": MAX_PACKET, "max_bin_len": 0, "max_array_len": 4096,
           "max_map_len": 4096, "max_ext_len": 0}
_STREAMS = 3  # stdin, stdout, stderr


class ForkServerError(Exception):
    """A message that breaks the protocol, or a server that refused or went away."""


def fingerprint() -> dict[str, str]:
    """What must match for a forked child to be the process `python -m executors` would start
    here: the interpreter, the import path's additions, and the flowkit it imports."""
    return {"executable": sys.executable, "pythonpath": os.environ.get("PYTHONPATH", ""),
            "flowkit": str(Path(__file__).resolve().parents[1])}


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a connected Unix socket (the kernel's
    word, SO_PEERCRED): each side talks only to its own user's processes."""
    return _peer_credentials(sock)[1]


def peer_pid(sock: socket.socket) -> int:
    """The process id at the other end of a connected Unix socket (SO_PEERCRED)."""
    return _peer_credentials(sock)[0]


def _peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                               struct.calcsize("3i")))


def send(sock: socket.socket, message: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    data = msgpack.packb(message, use_bin_type=True)
    if len(data) > MAX_PACKET:
        raise ForkServerError(f"a message of {len(data)} bytes (at most {MAX_PACKET})")
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def receive(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and the descriptors that came with it; (None, []) at the end of the
    connection. ForkServerError for anything but one bounded msgpack map (its descriptors
    closed first)."""
    fds = array.array("i")
    data, ancillary, flags, _ = sock.recvmsg(MAX_PACKET + 1,
                                             socket.CMSG_SPACE(_STREAMS * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    received = list(fds)
    if not data and not received:
        return None, []
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise ForkServerError(f"a packet over {MAX_PACKET} bytes or with over {_STREAMS} "
                                  "descriptors")
        try:
            message = msgpack.unpackb(data, raw=False, **_LIMITS)
        except (ValueError, msgpack.UnpackException) as exc:
            raise ForkServerError(f"not a msgpack message ({exc})") from None
        if not isinstance(message, dict) or not all(isinstance(k, str) for k in message):
            raise ForkServerError("a message is a map with string keys")
        return message, received
    except ForkServerError:
        for fd in received:
            os.close(fd)
        raise


def check_start(request: Any, fds: list[int]) -> dict[str, Any]:
    """A start request's fields, checked: argv strings, env string to string, cwd an existing
    folder, watch a pid, and exactly three descriptors."""
    if len(fds) != _STREAMS:
        raise ForkServerError(f"a start comes with {_STREAMS} descriptors, not {len(fds)}")
    if not isinstance(request, dict) or set(request) != {"argv", "env", "cwd", "watch"}:
        raise ForkServerError("a start names argv, env, cwd and watch, nothing else")
    argv, env, cwd, watch = (request[k] for k in ("argv", "env", "cwd", "watch"))
    if not isinstance(argv, list) or not all(isinstance(a, str) and "\0" not in a for a in argv):
        raise ForkServerError("argv is a list of strings")
    if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k and "=" not in k
            and "\0" not in k + v for k, v in env.items()):
        raise ForkServerError("env maps variable names to strings")
    if not isinstance(cwd, str) or "\0" in cwd or not os.path.isdir(cwd):
        raise ForkServerError(f"cwd {str(cwd)[:200]!r} is not a folder")
    check_pid(watch, "watch", "the pid of the process the child dies with")
    return {"argv": argv, "env": env, "cwd": cwd, "watch": watch}


def check_pid(value: Any, field: str, what: str = "a process id") -> int:
    """A pid in a message: an int above 1 (0 and 1 are no launcher's) that fits a pid_t."""
    if not isinstance(value, int) or isinstance(value, bool) or not 1 < value < 1 << 31:
        raise ForkServerError(f"{field} is {what}")
    return value
