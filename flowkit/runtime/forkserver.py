"""The launcher's side of the fork server [Note: fork server in executors/forkserver.py]:
`start_executor(argv, env, preload=...)` forks `python -m executors ARGV` from a server that has
imported what it needs, and returns a `ForkedProcess`, which answers as a subprocess.Popen does
(pid, poll, wait, kill, returncode); None where no server can serve it, and the caller starts a
process as before.

Which server, by FLOWKIT_FORKSERVER: unset, one of this process's own, started on first use
per preload set (it dies with this process); a socket path, a server that someone else runs
(the test suite runs one per worker: CLI runs of the tests share it); `off`, none."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from flowkit.runtime.spawn import spawn
from flowkit.wire.forkserver import (
    ForkServerError,
    fingerprint,
    peer_pid,
    peer_uid,
    receive,
    send,
)

__all__ = ["ForkServer", "ForkedProcess", "executor_processes", "start_executor",
           "start_server", "without_shared_server"]

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0  # a server's imports, on a loaded machine
_UNKNOWN_EXIT = 255  # a child whose server went away before it could say how it ended
_OFF = ("off", "0", "no", "false")  # FLOWKIT_FORKSERVER's settings for no server


class ForkedProcess:
    """A child of a fork server, as much of subprocess.Popen as the launchers use."""

    def __init__(self, pid: int, args: Sequence[str]) -> None:
        self.pid, self.args = pid, list(args)
        self.returncode: int | None = None
        self._ended = threading.Event()
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:  # already gone and reaped: its "exited" is on its way
            self._pidfd = None

    def _exited(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._ended.set()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _orphaned(self) -> None:
        """Its server went away: from now on its end is seen through its pidfd alone."""
        if self._pidfd is None or select.select([self._pidfd], [], [], 0)[0]:
            self._exited(_UNKNOWN_EXIT)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, signum: int) -> None:
        pidfd = self._pidfd
        if self.returncode is not None or pidfd is None:
            return
        try:  # through the pidfd: never a later process that got the same pid
            signal.pidfd_send_signal(pidfd, signum)
        except (ProcessLookupError, OSError):
            pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class ForkServerRefused(ForkServerError):
    """A fork server that answered this process's hello with a refusal: it imports another
    interpreter, import path or flowkit (`fingerprint`), or runs as another user. Waiting
    changes nothing."""


class ForkServer:
    """A connection to a fork server at `path`; ForkServerError if it refuses this process
    (another interpreter, import path or flowkit) or is not there."""

    def __init__(self, path: str, process: subprocess.Popen | None = None) -> None:
        self.path, self.process = path, process
        self.sock = _greeted(path)
        self.alive = True
        self._lock = threading.Lock()  # one start at a time: replies come in order
        self._started: list[ForkedProcess | ForkServerError] = []
        self._answered = threading.Condition()
        self._children: dict[int, ForkedProcess] = {}
        self._closing = False
        threading.Thread(target=self._read, name="flowkit-forkserver", daemon=True).start()

    def start(self, argv: Sequence[str], env: dict[str, str],
              streams: tuple[int, int, int]) -> ForkedProcess:
        request = {"argv": list(argv), "env": dict(env), "cwd": os.getcwd(),
                   "watch": os.getpid()}
        with self._lock, self._answered:
            if not self.alive:
                raise ForkServerError(f"the fork server at {self.path} is gone")
            send(self.sock, {"start": request}, streams)
            if not self._answered.wait_for(lambda: self._started or not self.alive, 30.0):
                raise ForkServerError(f"the fork server at {self.path} did not answer")
            if not self._started:
                raise ForkServerError(f"the fork server at {self.path} went away")
            answer = self._started.pop(0)
        if isinstance(answer, ForkServerError):
            raise answer
        return answer

    def _read(self) -> None:
        try:
            while True:
                message, fds = receive(self.sock)
                for fd in fds:
                    os.close(fd)
                if message is None:
                    break
                self._take(message)
        except (OSError, ForkServerError) as exc:
            if not self._closing:  # else this process closed the socket under the read
                log.warning("the fork server at %s: %s", self.path, exc)
        with self._answered:
            self.alive = False
            self._answered.notify_all()
        for child in list(self._children.values()):
            child._orphaned()

    def _take(self, message: dict[str, Any]) -> None:
        if "exited" in message:
            child = self._children.pop(message["exited"], None)
            if child is not None and isinstance(message.get("code"), int):
                child._exited(message["code"])
            return
        if isinstance(message.get("started"), int):
            child = ForkedProcess(message["started"], ["python", "-m", "executors"])
            self._children[child.pid] = child
            answer: ForkedProcess | ForkServerError = child
        else:
            answer = ForkServerError(f"the fork server refused: {_why(message)}")
        with self._answered:
            self._started.append(answer)
            self._answered.notify_all()

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):  # the reader sees the end, not a closed descriptor
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


def _greeted(path: str) -> socket.socket:
    """A connection to the fork server at `path` that has said hello and been answered."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)
        owner = peer_uid(sock)
        if owner != os.getuid():  # it would see the executors' environment, secret included
            sock.close()
            raise ForkServerRefused(f"the fork server at {path} runs as user {owner}, not "
                                    f"as this one ({os.getuid()}): refused")
        send(sock, {"hello": fingerprint()})
        reply, _ = receive(sock)
    except OSError as exc:
        sock.close()
        raise ForkServerError(f"no fork server at {path} ({exc})") from None
    if reply != {"ok": True}:
        sock.close()
        raise ForkServerRefused(f"the fork server at {path} refused: {_why(reply)}")
    return sock


def _why(reply: Any) -> str:
    return str(reply.get("refused") if isinstance(reply, dict) else reply)[:500]


def start_server(preload: Sequence[str] = (), *, env: dict[str, str] | None = None,
                 timeout: float = _START_TIMEOUT_S) -> ForkServer:
    """A fork server of this process's own (it dies with this process), connected, once its
    imports of `preload` are done."""
    folder = tempfile.mkdtemp(prefix="flowkit-fork-")  # owner-only: the socket's first guard
    path = os.path.join(folder, "socket")
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                   **(env or {})}  # torch reads them as it loads, in the server
    process = spawn([sys.executable, "-m", "executors.forkserver", "--socket", path,
                     "--preload", ",".join(preload)], env=environment, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    refused: ForkServerRefused | None = None
    while True:
        if os.path.exists(path):
            try:
                return ForkServer(path, process)
            except ForkServerRefused as exc:  # e.g. run from another checkout's folder,
                refused = exc  # whose flowkit the server imports first: no wait helps
            except ForkServerError:  # not listening yet
                pass
        if refused or process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            process.wait()
            shutil.rmtree(folder, ignore_errors=True)
            raise refused or ForkServerError(
                f"the fork server did not start (exit {process.returncode})")
        time.sleep(0.02)


_servers: dict[Any, ForkServer | None] = {}
_refused: set = set()  # keys whose server refused this process: it would again
_servers_lock = threading.Lock()
_servers_owner = os.getpid()


def _server_for(preload: tuple[str, ...]) -> ForkServer | None:
    global _servers_owner
    setting = os.environ.get("FLOWKIT_FORKSERVER", "")
    if setting.lower() in _OFF:
        return None
    key = setting or preload
    with _servers_lock:
        if _servers_owner != os.getpid():  # a forked copy of this process: none are its own
            _servers.clear()
            _refused.clear()
            _servers_owner = os.getpid()
        server = _servers.get(key)
        if server is not None and server.alive:
            return server
        if key in _refused:  # each executor asking again would start and import again
            return None
        try:
            if setting:
                server = ForkServer(setting)
            else:
                server = start_server(preload)
                atexit.register(server.close)  # gone before this process is: nothing outlives it
        except ForkServerError as exc:
            log.warning("executors start without a fork server: %s", exc)
            if isinstance(exc, ForkServerRefused):
                _refused.add(key)
            server = None
        _servers[key] = server
        return server


def start_executor(argv: Sequence[str], env: dict[str, str], *,
                   preload: Sequence[str] = ()) -> ForkedProcess | None:
    """`python -m executors ARGV` in `env`, forked from a fork server that imported `preload`;
    None where none can (FLOWKIT_FORKSERVER=off, a server that refused or went away)."""
    if not hasattr(os, "pidfd_open"):
        return None
    server = _server_for(tuple(preload))
    if server is None:
        return None
    with open(os.devnull, "rb") as devnull:
        try:
            return server.start(argv, env, (devnull.fileno(), 1, 2))
        except (ForkServerError, OSError) as exc:
            log.warning("executor started without the fork server: %s", exc)
            return None


def without_shared_server(environ: dict[str, str] | None = None) -> dict[str, str]:
    """An environment for a `flowkit run` that starts its own fork server, whatever server
    this process was told to use (the executors are then the run's descendants)."""
    return {k: v for k, v in (os.environ if environ is None else environ).items()
            if k != "FLOWKIT_FORKSERVER"}


def executor_processes(parent: int) -> dict[int, str]:
    """The local executors process `parent` started, pid -> name: its children that run
    `python -m executors --name NAME`, the children of its fork server, and those the shared
    server FLOWKIT_FORKSERVER names forked for it; a forked one by its process name (which it
    sets to its --name, up to 15 bytes, first thing: until then it is not yet one)."""
    found = {}
    for pid, argv in _children(parent).items():
        if b"executors.forkserver" in argv:
            unnamed = _process_name(pid)
            for child in _children(pid):
                found[child] = "" if _process_name(child) == unnamed else _process_name(child)
        elif b"--name" in argv:
            found[pid] = argv[argv.index(b"--name") + 1].decode()
    shared = os.environ.get("FLOWKIT_FORKSERVER", "")
    if shared and shared.lower() not in _OFF:
        found.update(_served_for(shared, parent))
    return {pid: name for pid, name in found.items() if name}


def _served_for(path: str, launcher: int) -> dict[int, str]:
    """The live children the fork server at `path` forked for `launcher`, pid -> name; one
    that has not yet named itself still has the server's name, and is left out."""
    try:
        sock = _greeted(path)
    except ForkServerError:
        return {}
    with sock:
        try:
            send(sock, {"children_of": launcher})
            reply, _ = receive(sock)
        except (ForkServerError, OSError):  # it went away meanwhile
            return {}
        unnamed = _process_name(peer_pid(sock))
    children = reply.get("children") if isinstance(reply, dict) else None
    if not isinstance(children, list):
        return {}
    return {pid: name for pid in children if isinstance(pid, int)
            and (name := _process_name(pid)) and name != unnamed and _live_parent(pid) is not None}


def _children(parent: int) -> dict[int, list[bytes]]:
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if _live_parent(pid) != parent:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                found[pid] = cmdline.read().split(b"\0")
        except OSError:
            continue  # gone while we looked
    return found


def _live_parent(pid: int) -> int | None:
    """The parent of process `pid`; None when it is gone, or dead and not yet reaped (a zombie
    keeps its name: it is no executor)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state, ppid = stat.read().rsplit(b")", 1)[1].split()[:2]
        return None if state in (b"Z", b"X") else int(ppid)
    except (OSError, ValueError, IndexError):
        return None


def _process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip()
    except OSError:
        return ""
