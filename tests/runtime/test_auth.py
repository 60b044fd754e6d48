"""Authenticated transport [Note: authenticated transport in flowkit/wire/auth.py]: keys
folders, the refusal to bind beyond loopback unauthenticated, and real executor processes whose
every socket speaks CurveZMQ, which clients of our own, without keys or with unknown ones, cannot
get anything from or into."""

from __future__ import annotations

import ipaddress
import logging
import os
import subprocess
import sys

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from flowkit.runtime import Controller
from flowkit.wire.auth import InsecureBindError, Keys, KeysError, generate_keys, is_loopback
from flowkit.wire.hello import SECRET_ENV
from flowkit.wire.protocol import Msg, decode, encode
from flowkit.wire.serialize import pack
from tests.harness import executor_cluster

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Keys:
    return generate_keys(tmp_path_factory.mktemp("auth") / "keys")


# -- keys folders --------------------------------------------------------------------------------
def test_a_generated_folder_loads_with_both_pairs_and_the_executor_allowed(keys):
    again = Keys.load(keys.folder)
    assert again == keys
    assert again.allowed == {keys.executor_public}
    assert len({keys.controller_public, keys.executor_public}) == 2
    assert oct(keys.folder.stat().st_mode & 0o777) == "0o700"
    assert oct((keys.folder / "controller.key_secret").stat().st_mode & 0o777) == "0o600"


def test_keys_are_never_overwritten(keys):
    with pytest.raises(KeysError, match="already holds keys"):
        generate_keys(keys.folder)


def test_a_missing_or_incomplete_folder_is_refused_saying_how_to_fix_it(tmp_path, keys):
    with pytest.raises(KeysError, match="does not exist: make one with `flowkit keys generate"):
        Keys.load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(KeysError, match="no controller.key"):
        Keys.load(tmp_path / "empty")
    copy = _copy(keys, tmp_path / "no-allowed", skip=("allowed/executor.key",))
    with pytest.raises(KeysError, match="holds no public key"):
        Keys.load(copy)
    garbled = _copy(keys, tmp_path / "garbled", skip=())
    (garbled / "executor.key_secret").write_text("not a certificate\n")
    with pytest.raises(KeysError, match="cannot read .*executor.key_secret"):
        Keys.load(garbled)


def test_an_executor_hosts_copy_serves_executors_but_not_a_controller(tmp_path, keys):
    copy = Keys.load(_copy(keys, tmp_path / "executor-host", skip=("controller.key_secret",)))
    assert copy.controller_secret is None and copy.secret("executor") == keys.executor_secret
    with pytest.raises(KeysError, match="no controller.key_secret, which the controller needs"):
        Controller(keys=copy)


def _copy(keys: Keys, to, *, skip: tuple[str, ...]):
    for path in keys.folder.rglob("*"):
        relative = path.relative_to(keys.folder).as_posix()
        if path.is_file() and relative not in skip:
            (to / relative).parent.mkdir(parents=True, exist_ok=True)
            (to / relative).write_bytes(path.read_bytes())
    return to


# -- binding -------------------------------------------------------------------------------------
@given(st.ip_addresses())
def test_an_ip_is_loopback_exactly_when_ipaddress_says_so(address):
    host = f"[{address}]" if address.version == 6 else str(address)
    assert is_loopback(f"tcp://{host}:5555") == address.is_loopback


@pytest.mark.parametrize("endpoint", ["tcp://*:5555", "tcp://0.0.0.0:0", "tcp://eth0:0",
                                      "tcp://example.org:5555", "tcp://10.0.0.5:0"])
def test_reachable_endpoints_are_not_loopback(endpoint):
    assert not is_loopback(endpoint)


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:0", "tcp://localhost:5", "tcp://[::1]:0",
                                      "ipc:///tmp/flowkit-x", "inproc://x"])
def test_local_endpoints_are_loopback(endpoint):
    assert is_loopback(endpoint)


def test_binding_beyond_loopback_without_keys_is_refused_naming_the_options():
    with pytest.raises(InsecureBindError, match=r"pass --keys DIR .* or --insecure"):
        Controller(bind="tcp://0.0.0.0:0")
    with Controller(bind="tcp://0.0.0.0:0", insecure=True) as ctl:
        assert ctl.executor_options() == ["--insecure"]


def test_binding_beyond_loopback_with_keys_is_allowed(keys):
    with Controller(bind="tcp://0.0.0.0:0", keys=keys) as ctl:
        assert ctl.executor_options() == ["--keys", str(keys.folder.resolve())]


# -- real processes ------------------------------------------------------------------------------
def test_executors_with_keys_run_tasks_and_move_objects_between_them(keys):
    with executor_cluster(2, keys=keys) as (ctl, (a, b)):
        made = ctl.submit("make_tensor", config={"nbytes": 3 << 20}, executor=a.id)
        moved = ctl.submit("identity", made, executor=b.id)  # peer to peer, over CURVE
        assert ctl.submit("nbytes", moved, executor=b.id).result(timeout=30) == 3 << 20
        assert ctl.put([1, "two"], executor=b.id).result(timeout=30) == [1, "two"]


def _client(kind: str, keys: Keys, server: str) -> zmq.Socket:
    """A socket of our own: no keys, a key pair the folder does not allow (but the right server
    key), or the run's own executor keys (the legitimate client)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if kind != "no keys":
        public, secret = ((keys.executor_public, keys.executor_secret) if kind == "legit"
                          else zmq.curve_keypair())
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = keys.public(server)
    return sock


def _intrude(sock: zmq.Socket, frames: list) -> None:
    """An intruder's message, queued for its connection while the server has not refused the
    handshake yet, else dropped: a DEALER whose only connection is gone would block for ever
    (it did once, the server having refused before the send)."""
    try:
        sock.send_multipart(frames, flags=zmq.NOBLOCK)
    except zmq.Again:
        pass


def _answers(sock: zmq.Socket, seconds: float) -> list:
    got = []
    while sock.poll(int(seconds * 1000)):
        got.append(decode(sock.recv_multipart())[0])
        seconds = 0.2
    return got


HELLO = {"name": "intruder", "tags": [], "ops": ["noop", "identity"], "pid": 1,
         "peer_address": "tcp://127.0.0.1:9", "host_id": "elsewhere"}


@pytest.mark.parametrize("intruder", ["no keys", "unknown key pair"])
def test_a_client_without_allowed_keys_cannot_join_a_controller_nor_get_tasks(keys, intruder,
                                                                              caplog):
    caplog.set_level(logging.WARNING, logger="flowkit.auth")
    with executor_cluster(1, keys=keys) as (ctl, _):
        sock = _client(intruder, keys, "controller")
        sock.connect(ctl.address)
        _intrude(sock, encode(Msg.HELLO, {**HELLO, "secret": ctl.secret.hex()}))
        heartbeat = _client(intruder, keys, "controller")
        heartbeat.connect(ctl._heartbeat.address)
        _intrude(heartbeat, encode(Msg.PING, {"executor": 0}))
        assert _answers(sock, 1.0) == [] and _answers(heartbeat, 0.2) == []
        assert [e.name for e in ctl.executors()] == ["exec-0"]
        # the run goes on; none of its tasks went to the intruder, which got nothing at all
        assert [ctl.submit("identity", i).result(timeout=30) for i in range(20)] == [*range(20)]
        assert _answers(sock, 0.3) == []
        assert ctl._gate.refused >= 2
        sock.close()
        heartbeat.close()
    said = ("the controller refused a client at 127.0.0.1: its public key"
            if intruder == "unknown key pair" else
            f"the controller dropped a connection to {ctl.address}: its CURVE handshake failed")
    assert said in caplog.text and "nothing it sent was read" in caplog.text


def test_the_legit_client_is_what_the_intruder_test_would_see_otherwise(keys):
    """The same HELLO with the run's own keys joins: the refusals above are the keys' doing."""
    with executor_cluster(1, keys=keys) as (ctl, _):
        sock = _client("legit", keys, "controller")
        sock.connect(ctl.address)
        sock.send_multipart(encode(Msg.HELLO, {**HELLO, "secret": ctl.secret.hex()}))
        assert [h["t"] for h in _answers(sock, 5.0)] == [Msg.WELCOME]
        sock.close()


@pytest.mark.parametrize("intruder", ["no keys", "unknown key pair", "without keys anywhere"])
def test_an_executors_peer_socket_takes_objects_only_from_allowed_keys(keys, intruder, capfd):
    """B waits for an object A makes slowly; meanwhile an intruder pushes a forged object with
    that id to B's peer socket, well-formed. B never reads it: its gate drops the connection,
    with keys for its key, without keys anywhere for its lack of the run's password [Note:
    strangers stop at the handshake in flowkit/wire/auth.py]; B runs on A's object."""
    options = {} if intruder == "without keys anywhere" else {"keys": keys}
    with executor_cluster(2, **options) as (ctl, (a, b)):
        genuine = ctl.put("genuine", executor=a.id)
        slow = ctl.submit("identity", genuine, config={"seconds": 1.5}, executor=a.id)
        used = ctl.submit("identity", slow, executor=b.id)
        sock = _client("no keys" if not options else intruder, keys, "executor")
        sock.connect(b.peer_address)
        body, frames = pack("forged")
        _intrude(sock, encode(Msg.DATA, {"object": slow.id, "meta": {"body": body}}, frames))
        assert used.result(timeout=30) == "genuine"
        # the run goes on: B still takes objects from A and runs tasks
        assert ctl.submit("identity", genuine, executor=b.id).result(timeout=30) == "genuine"
        sock.close()
    logged = capfd.readouterr().err  # the executors' stderr: they inherit this process's
    assert f"executor {b.name}" in logged and "nothing it sent was read" in logged, logged


@pytest.mark.slow
def test_across_namespace_hosts_objects_cross_encrypted_and_no_intruder_gets_in(keys):
    """Executors on two network-namespace hosts (flowkit/runtime/netns.py), the controller on
    the bridge: bytes cross as frames over CURVE, and a client of ours on the bridge, with
    a key pair of its own, forges nothing into the far executor."""
    from flowkit.runtime.netns import HostExecutors, NamespaceHosts, unavailable

    why = unavailable()
    if why is not None:
        pytest.skip(f"no network namespaces here: {why}")
    with NamespaceHosts(2) as hosts, Controller(bind=hosts.bind, keys=keys) as ctl, \
            HostExecutors(ctl, hosts.hosts) as (a, b):
        assert b.peer_address.startswith(f"tcp://{hosts.hosts[1].address}:")
        made = ctl.submit("make_tensor", config={"nbytes": 3 << 20}, executor=a.id)
        assert ctl.submit("nbytes", made, executor=b.id).result(timeout=30) == 3 << 20
        genuine = ctl.put("genuine", executor=a.id)
        slow = ctl.submit("identity", genuine, config={"seconds": 1.0}, executor=a.id)
        used = ctl.submit("identity", slow, executor=b.id)
        sock = _client("unknown key pair", keys, "executor")
        sock.connect(b.peer_address)
        body, frames = pack("forged")
        _intrude(sock, encode(Msg.DATA, {"object": slow.id, "meta": {"body": body}}, frames))
        assert used.result(timeout=30) == "genuine"
        sock.close()


def test_an_executor_with_other_keys_never_joins(keys, tmp_path):
    """A real executor process holding another folder's keys: the controller's gate drops it,
    so it never joins and no task can reach it; it exits saying so, at once."""
    other = generate_keys(tmp_path / "other")
    with Controller(keys=keys) as ctl:
        done = subprocess.run([sys.executable, "-m", "executors", "--connect", ctl.address,
                               "--keys", str(other.folder)], stdin=subprocess.DEVNULL,
                              env={**os.environ, SECRET_ENV: ctl.secret.hex()},
                              capture_output=True, text=True, timeout=25)
        assert ctl._gate.refused >= 1 and not ctl.executors()
    assert done.returncode == 2 and "gate refused the connection: keys not among" in \
        done.stderr, done.stderr


def test_loopback_is_what_it_was_without_keys():
    with Controller() as ctl:
        assert ctl.keys is None and not ctl._gate.curve and ctl.executor_options() == []
        assert ipaddress.ip_address(ctl.address.split("//")[1].rsplit(":", 1)[0]).is_loopback
