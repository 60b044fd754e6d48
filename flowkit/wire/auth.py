"""Keys, CurveZMQ on every socket, and the gate that admits only known public keys (or, without
keys, only holders of the run's secret).

The design: [Note: authenticated transport] below.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import re
import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
import zmq
import zmq.auth
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

__all__ = ["Gate", "InsecureBindError", "Keys", "KeysError", "check_bind",
           "curve_client", "curve_server", "generate_keys", "is_loopback", "plain_client",
           "plain_server", "transport_password"]


# [Note: authenticated transport] By default everything binds to loopback, and a connection is
# let in by the run's secret alone (below). Beyond loopback, every socket authenticates
# and encrypts with CurveZMQ (RFC 26), from the keys `flowkit keys generate DIR` writes: every
# socket that binds serves with the controller's or the executor's pair, every executor is a
# client, and DIR alone tells each side every server key (none travels on the wire). CURVE lets in
# any client that knows a server's public key, so every process that binds runs a ZAP handler
# (`Gate`, RFC 27) bound before any of its servers binds, admitting only DIR/allowed/'s keys; a
# key pinned to an executor name comes back as the ZAP User-Id, and the controller refuses a
# HELLO naming another executor [Note: joining a run in flowkit/wire/hello.py]. A refused
# connection is dropped before any message is delivered, so nothing it sends is decoded.
# `check_bind` refuses a non-loopback address without keys unless the caller says `insecure`.
# Shared memory between executors of one host is unchanged (only a handle crosses the socket).
# Keys, servers and the gate in full: docs/runtime.md, "Executors on other hosts, and keys".
#
# [Note: strangers stop at the handshake] Without keys the gate still stands: every server is a
# ZMTP PLAIN server that admits only a client whose password is derived from the run's secret
# [Note: joining a run in flowkit/wire/hello.py], so a stranger's connection is dropped in its
# handshake, before any of its messages is queued or decoded. A stranger's messages must not
# reach a socket's queues: libzmq 4.3.5 aborts the whole process (`Assertion failed: !_io_error
# (src/stream_engine_base.cpp:310)`) when a connection whose receive queue is full closes and a
# ZMTP PING is then due on it (zeromq/libzmq#4364, #4841; no fix released). A flood that hung
# up did it to the controller in 1 of 4 runs of tests/security/test_floods.py; test_zmtp.py
# shows it in a second. The bulk servers send no PINGs [Note: liveness], and a stranger never
# fills a queue. PLAIN costs nothing per message (the gate checks the password once a
# connection); it is not encryption: the password crosses loopback in clear, as the HELLO's
# secret always did.

log = logging.getLogger("flowkit.auth")

CONTROLLER, EXECUTOR, ALLOWED = "controller", "executor", "allowed"
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27: one handler per zmq context
_ZAP_DOMAIN = b"flowkit"
_PLAIN_USER = b"flowkit"
_LOG_EVERY_S = 60.0
_EXECUTORS = "executors"  # DIR/executors/NAME.key(_secret): a pair pinned to an executor name
_NAME_FIELD = "executor-name"
_KEY_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
_PINNED = re.compile(r'^\s+executor-name = "([^"]*)"\s*$', re.M)
# handshakes that fail before ZAP is asked (no keys, a wrong server key); ZAP's own refusals
# are logged by the gate with the client's key
_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)


class KeysError(ValueError):
    """A keys folder that cannot be used; the text says what is missing and how to fix it."""


class InsecureBindError(ValueError):
    """A non-loopback bind without keys or an explicit insecure."""


@attrs.frozen(kw_only=True)
class Keys:
    """The key pairs of a keys folder [Note: authenticated transport]; secrets may be None on
    a host that does not need them."""

    folder: Path
    controller_public: bytes
    controller_secret: bytes | None
    executor_public: bytes
    executor_secret: bytes | None
    allowed: frozenset[bytes]  # the client public keys let in
    pinned: dict[bytes, str] = attrs.field(factory=dict)  # allowed key -> the name it speaks as
    # this executor's own client pair, where the folder has one for its name
    own_public: bytes | None = None
    own_secret: bytes | None = None

    @classmethod
    def load(cls, folder: str | Path, name: str | None = None) -> Keys:
        """The keys in `folder`; with `name`, an executor's, its own client pair if the folder
        has one (`flowkit keys generate DIR --executors NAME,...`)."""
        folder = Path(folder)
        _check_curve()
        if not folder.is_dir():
            raise KeysError(f"keys folder {folder} does not exist: make one with "
                            f"`flowkit keys generate {folder}`")
        controller_public, controller_secret = _pair(folder, CONTROLLER)
        executor_public, executor_secret = _pair(folder, EXECUTOR)
        allowed_dir = folder / ALLOWED
        allowed = (frozenset(zmq.auth.load_certificates(allowed_dir))
                   if allowed_dir.is_dir() else frozenset())
        if not allowed:
            raise KeysError(f"{allowed_dir} holds no public key (*.key), so no client could "
                            f"connect: copy {folder / (EXECUTOR + '.key')} there, or make the "
                            f"folder again with `flowkit keys generate`")
        own_public = own_secret = None
        if name is not None and (folder / _EXECUTORS).is_dir():
            if not (folder / _EXECUTORS / f"{name}.key").is_file():
                names = sorted(p.stem for p in (folder / _EXECUTORS).glob("*.key"))
                raise KeysError(f"{folder} holds keys for executors {', '.join(names)}, not for "
                                f"{name!r}: give --name one of them")
            own_public, own_secret = _pair(folder / _EXECUTORS, name)
        return cls(folder=folder, controller_public=controller_public,
                   controller_secret=controller_secret, executor_public=executor_public,
                   executor_secret=executor_secret, allowed=allowed,
                   pinned=_pinned(allowed_dir), own_public=own_public, own_secret=own_secret)

    def secret(self, role: str) -> bytes:
        """The secret key `role` (controller or executor) serves and connects with."""
        secret = self.controller_secret if role == CONTROLLER else self.executor_secret
        if secret is None:
            raise KeysError(f"{self.folder} has no {role}.key_secret, which the {role} needs: "
                            f"copy it from the folder `flowkit keys generate` wrote")
        return secret

    def public(self, role: str) -> bytes:
        return self.controller_public if role == CONTROLLER else self.executor_public


def generate_keys(folder: str | Path, executors: Sequence[str] = (), *,
                  force: bool = False) -> Keys:
    """Write a fresh keys folder (it must not hold keys yet) and return its keys; with
    `executors` (names), a client pair pinned to each name instead of one shared by all. Its
    `allowed/` must be empty: a client key left there would still be let in; `force` empties
    it first."""
    folder = Path(folder)
    _check_curve()
    for name in executors:  # before anything is written
        if not _KEY_NAME.fullmatch(name):
            raise KeysError(f"{name!r} cannot name an executor's keys: use letters, digits, "
                            f"'.', '_' and '-', like exec-0")
    existing = [p.name for p in [*folder.glob("*.key*"), *folder.glob(f"{_EXECUTORS}/*.key*")]
                ] if folder.is_dir() else []
    if existing:
        raise KeysError(f"{folder} already holds keys ({', '.join(sorted(existing))}): remove "
                        f"them or choose another folder; keys are never overwritten")
    allowed = folder / ALLOWED
    left = sorted(p.name for p in allowed.iterdir()) if allowed.is_dir() else []
    if left and not force:
        raise KeysError(f"{allowed} is not empty ({', '.join(left[:5])}): the clients it allows "
                        "would still be let in; empty it, or give --force to remove them")
    for name in left:
        _remove(allowed / name)
    allowed.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    for name in (CONTROLLER, EXECUTOR):
        _, secret_file = zmq.auth.create_certificates(folder, name)
        Path(secret_file).chmod(0o600)
    if not executors:
        shutil.copy(folder / f"{EXECUTOR}.key", folder / ALLOWED / f"{EXECUTOR}.key")
        return Keys.load(folder)
    (folder / _EXECUTORS).mkdir(mode=0o700, exist_ok=True)
    for name in executors:
        public_file, secret_file = zmq.auth.create_certificates(folder / _EXECUTORS, name)
        Path(secret_file).chmod(0o600)
        public, _ = zmq.auth.load_certificate(public_file)
        (folder / ALLOWED / f"{name}.key").write_text(
            f"#   flowkit: executor {name}'s public key, pinned to its name\n"
            f"metadata\n    {_NAME_FIELD} = \"{name}\"\ncurve\n"
            f"    public-key = \"{public.decode()}\"\n")
    return Keys.load(folder)


def _pinned(allowed_dir: Path) -> dict[bytes, str]:
    """Allowed public key -> the executor name its certificate's metadata pins it to."""
    pinned = {}
    for path in allowed_dir.glob("*.key") if allowed_dir.is_dir() else ():
        found = _PINNED.search(path.read_text(errors="replace"))
        if found:
            public, _ = zmq.auth.load_certificate(path)
            pinned[public] = found.group(1)
    return pinned


def _remove(path: Path) -> None:
    """Remove a file or link (never following it), or a folder and what it holds."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _pair(folder: Path, name: str) -> tuple[bytes, bytes | None]:
    public_file, secret_file = folder / f"{name}.key", folder / f"{name}.key_secret"
    for path in (secret_file, public_file):
        if path.is_file():
            try:
                public, secret = zmq.auth.load_certificate(path)
            except (OSError, ValueError) as exc:
                raise KeysError(f"cannot read {path} as a zmq certificate ({exc}): make the "
                                f"folder again with `flowkit keys generate DIR`") from None
            return public, secret
    raise KeysError(f"{folder} has no {name}.key: not a keys folder, or an incomplete copy of "
                    f"one; make one with `flowkit keys generate DIR`")


def _check_curve() -> None:
    if not zmq.has("curve"):
        raise KeysError(f"this libzmq ({zmq.zmq_version()}) was built without CURVE, so keys "
                        "cannot be used: install a pyzmq wheel (they bundle libsodium) or a "
                        "libzmq built with libsodium")


# -- binding -------------------------------------------------------------------------------------
def is_loopback(endpoint: str) -> bool:
    """Whether only this machine can reach `endpoint` (a zmq bind address)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rpartition(":")[0].strip("[]") if ":" in rest else rest
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # *, an interface name, a host name: reachable from elsewhere
        return False


def check_bind(endpoint: str, *, keys: Keys | None, insecure: bool, who: str) -> None:
    """Refuse to bind `endpoint` beyond loopback unauthenticated [Note: authenticated
    transport]; `who` names the command whose options fix it."""
    if keys is not None or insecure or is_loopback(endpoint):
        return
    raise InsecureBindError(
        f"{who} would bind {endpoint}, which other machines can reach, without "
        f"authentication: pass --keys DIR (made by `flowkit keys generate DIR`) so only "
        f"holders of its keys connect, or --insecure to accept anyone who reaches it")


def curve_server(sock: zmq.Socket, keys: Keys, role: str) -> None:
    """Make `sock` (before it binds) a CURVE server with `role`'s key pair."""
    sock.curve_secretkey = keys.secret(role)
    sock.curve_publickey = keys.public(role)
    sock.zap_domain = _ZAP_DOMAIN
    sock.curve_server = True


def curve_client(sock: zmq.Socket, keys: Keys, server: str) -> None:
    """Make `sock` (before it connects) a CURVE client, as an executor, of a `server` role:
    with the executor's own pair where it has one, else the shared one."""
    if keys.own_secret is not None and keys.own_public is not None:
        sock.curve_secretkey, sock.curve_publickey = keys.own_secret, keys.own_public
    else:
        sock.curve_secretkey = keys.secret(EXECUTOR)
        sock.curve_publickey = keys.executor_public
    sock.curve_serverkey = keys.public(server)


def transport_password(secret: bytes) -> bytes:
    """What a keyless connection presents in its PLAIN handshake: derived from the run's secret
    (HMAC-SHA256), never the secret itself [Note: strangers stop at the handshake]."""
    return hmac.new(secret, b"flowkit transport", "sha256").hexdigest().encode()


def plain_server(sock: zmq.Socket) -> None:
    """Make `sock` (before it binds) a PLAIN server: its gate checks each client's password."""
    sock.zap_domain = _ZAP_DOMAIN
    sock.plain_server = True


def plain_client(sock: zmq.Socket, secret: bytes) -> None:
    """Make `sock` (before it connects) a PLAIN client of a server of the run of `secret`."""
    sock.plain_username = _PLAIN_USER
    sock.plain_password = transport_password(secret)


# -- the gate ------------------------------------------------------------------------------------
class Gate(threading.Thread):
    """The ZAP handler of one zmq context, and the monitor of its servers' handshakes:
    `gate = Gate(context, keys)` (or `Gate(context, secret=...)` without keys) before the first
    server socket binds, `gate.watch(sock)` after each binds, `gate.start()`, and `gate.stop()`
    before the sockets close."""

    def __init__(self, context: zmq.Context, keys: Keys | None = None, *,
                 secret: bytes | None = None, owner: str) -> None:
        super().__init__(name="flowkit-gate", daemon=True)
        if (keys is None) == (secret is None):
            raise ValueError("a gate admits by keys or by the run's secret: give one of them")
        self.curve = keys is not None
        self.allowed = keys.allowed if keys is not None else frozenset()
        self.pinned = keys.pinned if keys is not None else {}
        self.password = None if secret is None else transport_password(secret)
        self.owner = owner
        self.refused = 0  # connections dropped, for tests and logs
        self.zap = context.socket(zmq.REP)
        self.zap.setsockopt(zmq.LINGER, 0)
        try:
            self.zap.bind(_ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            self.zap.close()
            raise RuntimeError(f"{owner}: another gate already serves this zmq context ({exc});"
                               " give each server process its own context") from None
        self.monitors: list[zmq.Socket] = []
        self._stop_event = threading.Event()
        self._logged: dict[str, float] = {}  # what was refused -> when it was last logged

    def watch(self, sock: zmq.Socket) -> None:
        self.monitors.append(sock.get_monitor_socket(_FAILED))

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=2.0)

    def run(self) -> None:
        poller = zmq.Poller()
        for sock in (self.zap, *self.monitors):
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop_event.is_set():
                for sock, _ in poller.poll(100):
                    if sock is self.zap:
                        self._answer(sock.recv_multipart())
                    else:
                        self.failed(recv_monitor_message(sock))
        finally:
            for sock in (self.zap, *self.monitors):
                sock.close(linger=0)

    def _answer(self, request: list[bytes]) -> None:
        # RFC 27: version, request id, domain, address, identity, mechanism, credentials...
        version, request_id, _, address, _, mechanism, *credentials = request
        admitted, what = (self._curve_client(mechanism, credentials) if self.curve else
                          self._plain_client(mechanism, credentials))
        if admitted is not None:
            self.zap.send_multipart([version, request_id, b"200", b"OK", admitted, b""])
            return
        self._refuse(f"refused a client at {address.decode(errors='replace')}: its {what}")
        self.zap.send_multipart([version, request_id, b"400", b"not allowed", b"", b""])

    def _curve_client(self, mechanism: bytes, credentials: list[bytes]
                      ) -> tuple[bytes | None, str]:
        """(the User-Id to admit it with, or None), and what was wrong."""
        key = z85.encode(credentials[0]) if mechanism == b"CURVE" and credentials else None
        if key is not None and key in self.allowed:  # certificates hold Z85 text
            # a pinned key's name becomes the connection's User-Id, which the controller
            # holds its HELLO to
            return self.pinned.get(key, "").encode(), ""
        return None, (f"public key {key.decode()} is not an allowed one" if key is not None
                      else f"mechanism {mechanism.decode(errors='replace')} is not CURVE")

    def _plain_client(self, mechanism: bytes, credentials: list[bytes]
                      ) -> tuple[bytes | None, str]:
        if mechanism != b"PLAIN" or len(credentials) != 2:
            return None, f"mechanism {mechanism.decode(errors='replace')} is not PLAIN"
        if hmac.compare_digest(credentials[1], self.password):
            return b"", ""
        return None, "password is not this run's (it holds no secret of this run)"

    def failed(self, event: dict) -> None:
        """A failed handshake's monitor event: counted and logged (at a bounded rate)."""
        if event["event"] == zmq.EVENT_MONITOR_STOPPED:
            return
        what = ("CURVE handshake failed (no keys, or not this server's public key)" if self.curve
                else "handshake failed (no PLAIN password: not a client of this run)")
        self._refuse(f"dropped a connection to {event['endpoint'].decode(errors='replace')}: "
                     f"its {what}")

    def _refuse(self, what: str) -> None:
        # a refused client retries every 100 ms or so: one line per kind a minute is enough
        self.refused += 1
        now = time.monotonic()
        if now - self._logged.get(what, -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._logged[what] = now
            log.warning("%s %s; nothing it sent was read", self.owner, what)
