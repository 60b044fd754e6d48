"""Who may join a run: the run's secret, and the bounds and checks of a HELLO.

[Note: joining a run] An executor proves it was started for this run by the run's secret: 32
random bytes the controller makes when it starts, handed to the executors it launches outside
argv (the environment variable SECRET_ENV, hex) or, for executors started by hand, a 0600 file
(`flowkit executor --secret-file PATH`). The HELLO carries it; the controller compares it in
constant time and refuses a HELLO without it or with another: no WELCOME, no executor record,
so a local process that reaches the loopback port gets no task and can send nothing that counts.
Beyond that a HELLO is bounded (name, tags, ops, resources, addresses), its name is not a live
executor's, and the host of the peer address it advertises is the one its HELLO came from, so
it cannot point other executors' pushes at another machine. With `--keys`, an executor key pinned
to a name (`flowkit keys generate DIR --executors ...`) may only speak as that name.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from pathlib import Path
from typing import Any

import attrs

from flowkit.wire.schema import ProtocolError, shown

__all__ = ["HelloRefused", "Origin", "SECRET_ENV", "check_hello", "check_origin", "check_secret",
           "new_secret", "peer_tag", "read_secret_file", "secret_from_environment",
           "write_secret_file"]

SECRET_ENV = "FLOWKIT_RUN_SECRET"
SECRET_BYTES = 32

MAX_NAME = 128
MAX_TAGS, MAX_TAG = 64, 64
MAX_OPS, MAX_OP = 4096, 200
MAX_RESOURCES, MAX_RESOURCE_KEY, MAX_RESOURCE_TEXT = 64, 64, 256
MAX_TEXT = 256  # host, host id, device, peer address


class HelloRefused(ProtocolError):
    """A HELLO from a client that may not join this run; the text says why."""


@attrs.frozen
class Origin:
    """Where a HELLO came from, as the transport says: the peer's address (None where the
    transport has none: ipc, inproc) and the name its key is pinned to ("" for none)."""

    host: str | None = None
    user_id: str = ""


def check_origin(header: dict[str, Any], origin: Origin) -> None:
    """HelloRefused unless the HELLO's name is the one its key is pinned to (if it is), and its
    peer address (if any) is on the host it came from."""
    if origin.user_id and origin.user_id != header["name"]:
        raise HelloRefused(f"a HELLO naming {shown(header['name'])} over a connection whose key "
                           f"is {shown(origin.user_id)}'s: a pinned key speaks for its name only")
    if header.get("peer_address"):
        check_peer_host(header["peer_address"], origin.host)


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def secret_from_environment() -> bytes | None:
    """The run's secret its launcher put in this process's environment, removed from it so the
    processes an op starts do not inherit it; None if there is none."""
    text = os.environ.pop(SECRET_ENV, None)
    return None if text is None else _parse(text, f"environment variable {SECRET_ENV}")


def write_secret_file(path: str | Path, secret: bytes) -> Path:
    """Write `secret` (hex) to a new file only its owner may read, for executors started by
    hand (`flowkit executor --secret-file PATH`)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), 0o600)
        out.write(secret.hex() + "\n")
    return path


def read_secret_file(path: str | Path) -> bytes:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the run's secret from {path} ({exc}): give the file "
                         f"the controller wrote (`flowkit run --secret-file`)") from None
    return _parse(text, str(path))


def _parse(text: str, where: str) -> bytes:
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        secret = b""
    if len(secret) < 16:
        raise ValueError(f"{where} does not hold a run secret (at least 32 hex digits): give "
                         f"the one the controller wrote")
    return secret


def check_secret(header: dict[str, Any], secret: bytes) -> None:
    """HelloRefused unless the HELLO carries the run's secret; compared in constant time."""
    given = header.get("secret")
    if given is None:
        raise HelloRefused("a HELLO without the run's secret: start executors with the "
                           "launcher, or by hand with `flowkit executor --secret-file PATH`")
    if type(given) is not str or not hmac.compare_digest(
            given.encode("ascii", "replace"), secret.hex().encode()):
        raise HelloRefused("a HELLO with a wrong secret: it is not this run's (give the "
                           "executor the secret file of this run's controller)")


def peer_tag(secret: bytes) -> str:
    """What an executor's DATA carries to show it comes from a peer of this run: a tag derived
    from the run's secret (HMAC-SHA256), never the secret itself, so the receiver can refuse an
    object pushed by anyone else before it stores or decodes anything [Note: joining a run]."""
    return hmac.new(secret, b"flowkit peer data", "sha256").hexdigest()


def check_hello(header: dict[str, Any]) -> None:
    """ProtocolError naming the first HELLO field out of bounds or of a wrong type (the schema
    in protocol.py checked the top-level types of name, tags, ops and pid)."""
    _text("name", header["name"], MAX_NAME)
    if not header["name"]:
        raise ProtocolError("hello: the name is empty")
    _texts("tags", header["tags"], MAX_TAGS, MAX_TAG)
    _texts("ops", header["ops"], MAX_OPS, MAX_OP)
    for field in ("host", "host_id", "device", "peer_address"):
        if field in header:
            _text(field, header[field], MAX_TEXT)
    resources = header.get("resources", {})
    if type(resources) is not dict or len(resources) > MAX_RESOURCES:
        raise ProtocolError(f"hello: resources must be a map of at most {MAX_RESOURCES} "
                            f"entries, got {shown(resources)}")
    for key, value in resources.items():
        _text("a resource's name", key, MAX_RESOURCE_KEY)
        if type(value) is str:
            _text(f"resource {key}", value, MAX_RESOURCE_TEXT)
        elif type(value) not in (int, float, bool) and value is not None:
            raise ProtocolError(f"hello: resource {key} must be a number or text, got "
                                f"{shown(value)}")


def _text(field: str, value: Any, limit: int) -> None:
    # printable: a name or tag goes into logs, errors and the dashboard as it is
    if type(value) is not str or len(value) > limit or not value.isprintable():
        raise ProtocolError(f"hello: {field} must be printable text of at most {limit} "
                            f"characters, got {shown(value)}")


def _texts(field: str, values: list, count: int, limit: int) -> None:
    if len(values) > count:
        raise ProtocolError(f"hello: at most {count} {field}, got {len(values)}")
    for value in values:
        _text(f"each of {field}", value, limit)


def check_peer_host(peer_address: str, seen: str | None) -> None:
    """HelloRefused unless the host of the advertised peer address (tcp://HOST:PORT) is the
    address its HELLO came from (`seen`; None when the transport has none, ipc://: then the
    executor is on this machine, and its peers must reach it on loopback)."""
    scheme, _, rest = peer_address.partition("://")
    host, _, port = rest.rpartition(":")
    advertised = _address(host.strip("[]"))
    if scheme != "tcp" or advertised is None or not port.isdigit():
        raise HelloRefused(f"peer address {shown(peer_address)} is not tcp://ADDRESS:PORT "
                           "with a numeric address")
    expected = _address(seen) if seen else ipaddress.ip_address("127.0.0.1")
    same = advertised == expected or (advertised.is_loopback and expected is not None
                                      and expected.is_loopback)
    if not same:
        raise HelloRefused(f"peer address {shown(peer_address)} is not on the host its HELLO "
                           f"came from ({shown(seen)}): give --peer-host the address this "
                           f"machine reaches the controller from")


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped or address
