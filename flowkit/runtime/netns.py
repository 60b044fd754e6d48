"""Separate hosts on one machine: Linux network namespaces joined by a bridge, and executors
started on them. Tests and `flowkit bench dispatch|transfer --hosts 2` use them to run executors
on hosts that reach each other only over the network.

The design: [Note: namespace hosts] below.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import attrs

from flowkit.runtime.controller import Controller
from flowkit.runtime.launch import ProcessExecutors

__all__ = ["Host", "HostExecutors", "NamespaceError", "NamespaceHosts", "unavailable"]


# [Note: namespace hosts] `NamespaceHosts(2)` makes, for this process (names carry its pid), a
# bridge fk<pid>s<n>br (10.231.S.1/24, where the controller binds) in the root namespace and a
# namespace a host, fk-<pid>-<n>-a and -b (10.231.S.2 and .3 on eth0), each joined to the bridge
# by a veth pair; S is a /24 no address of this machine uses yet. A process on host a runs as
# `ip netns exec fk-<pid>-<n>-a CMD` (`Host.prefix`) and sees only its loopback and eth0, so what
# it says to another host crosses the kernel's TCP stack, as between machines. /dev/shm, pids and
# files stay shared, so hosts get host ids (`--host-id`) that decide what shares memory
# [Note: hosts in flowkit/wire/shm.py]. Everything (processes, veth pairs, namespaces, bridge) is
# removed on exit, on failure and at interpreter exit; leftovers of a killed process go when the
# next `NamespaceHosts` starts. Root and iproute2 needed; `unavailable()` says why not, by trying.

_SUBNET = "10.231"
_NAMESPACE = re.compile(r"fk-(\d+)-(\d+)-[a-z]\Z")
_BRIDGE = re.compile(r"fk(\d+)s(\d+)br\Z")
_serials = itertools.count()


class NamespaceError(RuntimeError):
    """Network namespaces cannot be made or used here; the text says what failed."""


@attrs.frozen(kw_only=True)
class Host:
    """Where executors run: a host id [Note: hosts] and the command prefix that runs a process
    there (none: this namespace)."""

    id: str
    address: str = "127.0.0.1"
    prefix: tuple[str, ...] = ()


def unavailable() -> str | None:
    """Why namespace hosts cannot be made here, or None if they can (found by trying)."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"fk-{os.getpid()}-99-p"
    try:
        _ip("netns", "add", probe)
    except NamespaceError as exc:
        return f"cannot make a network namespace (root with CAP_SYS_ADMIN needed): {exc}"
    try:
        _ip("-n", probe, "link", "add", "fkprobe", "type", "bridge")
        _ip("-n", probe, "link", "add", "fkprobe0", "type", "veth", "peer", "name", "fkprobe1")
        _ip("-n", probe, "link", "set", "fkprobe0", "master", "fkprobe")
    except NamespaceError as exc:
        return f"cannot make a bridge and veth pairs: {exc}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


class NamespaceHosts:
    """`with NamespaceHosts(2) as hosts:` bind the controller to `hosts.bind` and start executors
    on `hosts.hosts[i]` (HostExecutors); everything goes when the block ends [Note: namespace
    hosts]."""

    def __init__(self, count: int = 2) -> None:
        if not 1 <= count <= 26:
            raise ValueError(f"1 to 26 namespace hosts, not {count}")
        self.count = count
        serial = next(_serials) % 100
        self.tag = f"{os.getpid()}-{serial}"
        self.bridge = f"fk{os.getpid()}s{serial}br"
        self.namespaces = [f"fk-{self.tag}-{chr(ord('a') + i)}" for i in range(count)]
        self.veths = [f"fk{os.getpid()}s{serial}v{i}" for i in range(count)]
        self.hosts: list[Host] = []
        self.gateway = ""  # the bridge's address, on which the controller listens
        self._made: list[tuple[str, ...]] = []  # `ip` commands that delete what was made

    @property
    def bind(self) -> str:
        """A Controller bind address that every host reaches (the bridge, any port)."""
        return f"tcp://{self.gateway}:0"

    def __enter__(self) -> NamespaceHosts:
        self.create()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def create(self) -> None:
        _remove_stale()
        atexit.register(self.remove)
        try:
            self._create()
        except BaseException:
            self.remove()
            raise

    def _create(self) -> None:
        subnet = f"{_SUBNET}.{_free_octet()}"
        self.gateway = f"{subnet}.1"
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", "del", self.bridge))
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, (namespace, veth) in enumerate(zip(self.namespaces, self.veths, strict=True)):
            address = f"{subnet}.{i + 2}"
            _ip("netns", "add", namespace)
            self._made.append(("netns", "del", namespace))
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            self._made.append(("link", "del", veth))
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            self.hosts.append(Host(id=f"netns-{namespace}", address=address,
                                   prefix=("ip", "netns", "exec", namespace)))
        _wait_until_up([*self.veths, self.bridge])

    def remove(self) -> None:
        """Kill what still runs in the namespaces, then delete the links, namespaces and bridge.
        Safe to call twice, and after a failed create."""
        atexit.unregister(self.remove)
        for namespace in self.namespaces:
            _kill_inside(namespace)
        # veths first: a deleted namespace goes away asynchronously, its links with it, and
        # those must be gone when this returns
        order = {"link": 0, "netns": 1}
        for command in sorted(self._made, key=lambda c: 2 if c[2] == self.bridge else order[c[0]]):
            _ip(*command, check=False)
        self._made.clear()
        self.hosts.clear()

    def leftovers(self) -> list[str]:
        """The namespaces and links of these hosts that still exist (none after `remove`)."""
        names = set(self.namespaces) | set(self.veths) | {self.bridge}
        return sorted(names & (_namespaces() | _links()))


class HostExecutors(ProcessExecutors):
    """Executor processes on given hosts: executor i runs on `placement[i]`, named
    `{name_prefix}-{i}`, with that host's id; stopped and swept like LocalExecutors's."""

    def __init__(self, controller: Controller, placement: Sequence[Host], *, kind: str = "base",
                 tags: Sequence[str] = (), name_prefix: str = "exec",
                 log_level: str = "WARNING", startup_timeout: float = 60.0,
                 code: Sequence[str] = ()) -> None:
        super().__init__(controller, len(placement), name_prefix=name_prefix,
                         startup_timeout=startup_timeout)
        self.placement, self.kind, self.tags = list(placement), kind, tuple(tags)
        self.log_level, self.code = log_level, [str(path) for path in code]

    def _command(self, i: int) -> list[str]:
        # `ip netns exec` execs: the watched pid is python's
        host = self.placement[i]
        return [*host.prefix, sys.executable, "-m", "executors",
                "--connect", self.controller.address, "--name", f"{self.name_prefix}-{i}",
                "--kind", self.kind, "--tags", ",".join(self.tags), "--host-id", host.id,
                "--log-level", self.log_level, *self.controller.executor_options(),
                *(arg for path in self.code for arg in ("--code", path))]


# -- iproute2 ------------------------------------------------------------------------------------
def _ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NamespaceError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def _free_octet() -> int:
    """A third octet S such that no address of this machine is in 10.231.S.0/24."""
    used = set(re.findall(rf"inet {re.escape(_SUBNET)}\.(\d+)\.", _ip("-o", "-4", "addr")))
    start = os.getpid() % 250  # concurrent runs start their search in different places
    for step in range(254):
        octet = (start + step) % 254 + 1
        if str(octet) not in used:
            return octet
    raise NamespaceError(f"every {_SUBNET}.S.0/24 is in use on this machine")


def _wait_until_up(links: list[str], timeout: float = 5.0) -> None:
    # a bridge port forwards once it leaves the listening state; no STP here, so it does at once,
    # but the carrier of a fresh veth comes up asynchronously
    deadline = time.monotonic() + timeout
    while True:
        down = [link for link in links if "LOWER_UP" not in _ip("-o", "link", "show", link)]
        if not down:
            return
        if time.monotonic() > deadline:
            raise NamespaceError(f"links {down} did not come up within {timeout} s")
        time.sleep(0.02)


def _namespaces() -> set[str]:
    return {line.split()[0] for line in _ip("netns", "list", check=False).splitlines() if line}


def _links() -> set[str]:
    return set(re.findall(r"^\d+: ([^:@]+)[:@]", _ip("-o", "link", check=False), re.M))


def _kill_inside(namespace: str) -> None:
    for pid in _ip("netns", "pids", namespace, check=False).split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _remove_stale() -> None:
    """Namespaces and bridges left by processes that died before removing them."""
    for namespace in _namespaces():
        match = _NAMESPACE.match(namespace)
        if match and not _alive(int(match.group(1))):
            # its executors exit by themselves once their controller is silent, and the
            # namespace with its links goes with the last of them
            _ip("netns", "del", namespace, check=False)
    for link in _links():
        match = _BRIDGE.match(link)
        if match and not _alive(int(match.group(1))):
            _ip("link", "del", link, check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
