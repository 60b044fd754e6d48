"""Protocol fuzzing: random frames and msgpack values, ExtType included, sent to a run's
controller (by a stranger, and by an insider that joined with the run's secret) and to an
executor's data socket (by a stranger, and by an insider peer that holds the run's secret).
Nothing crashes, nothing hangs, memory stays bounded, nothing is imported, and the run goes on
to the results it has without them."""

from __future__ import annotations

import os
import sys

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowkit.wire.hello import peer_tag
from flowkit.wire.protocol import PROTOCOL_VERSION, Msg, decode, encode
from tests.harness import dealer, executor_cluster, process_of

# far above the ids the controller hands out, so an insider peer's objects never collide with
# the run's own (a collision is refused, which the messages tests show)
_FAR = 1 << 50

_TYPES = [value for name, value in vars(Msg).items() if name.isupper()]
_leaf = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
         | st.text(max_size=12) | st.binary(max_size=24))
_ext = st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=24))
_record = st.builds(lambda path, fields: msgpack.ExtType(3, msgpack.packb([path, fields])),
                    st.sampled_from(["os:system", "venv.__main__:x", "antigravity:x",
                                     "flowkit.ops.records:Prompt", "subprocess:Popen"]),
                    st.dictionaries(st.text(max_size=8), _leaf, max_size=3))
_inline_record = st.builds(  # [Note: records inline] in flowkit/wire/serialize.py
    lambda path, fields: {msgpack.ExtType(5, b""): path, **fields},
    st.sampled_from(["os:system", "antigravity:x", "flowkit.ops.records:Prompt", 7]),
    st.dictionaries(st.text(max_size=8) | st.integers(0, 3), _leaf, max_size=3))
_values = st.recursive(_leaf | _ext | _record | _inline_record,
                       lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)
_fields = st.dictionaries(st.sampled_from(
    ["task", "tasks", "items", "index", "first", "end", "start", "output", "outputs", "object",
     "objects", "request", "meta", "reason", "name", "tags", "ops", "pid", "executor", "token",
     "credited", "ok", "error", "to", "address", "auth"]), _values, max_size=6)


@st.composite
def _messages(draw) -> list[bytes]:
    """A message as bytes frames: mostly a header of a real type with random fields (the schema
    checks must hold), sometimes garbage."""
    frames = draw(st.lists(st.binary(max_size=64), max_size=3))
    if draw(st.integers(0, 9)) == 0:
        return [draw(st.binary(max_size=64)), *frames]
    header = {"v": draw(st.just(PROTOCOL_VERSION) | _leaf), "t": draw(st.sampled_from(_TYPES)),
              **draw(_fields)}
    if header["t"] == Msg.DATA and isinstance(header.get("object"), int):
        header["object"] = _FAR + abs(header["object"]) % _FAR
    if header["t"] == Msg.OBJECTS and draw(st.booleans()):  # well formed, the bodies anything
        bodies = st.binary(max_size=48) | _values.map(
            lambda v: msgpack.packb(v, use_bin_type=True))
        header["objects"] = [{"object": _FAR + draw(st.integers(0, _FAR - 1)), "body": body}
                             for body in draw(st.lists(bodies, max_size=4))]
    return [msgpack.packb(header, use_bin_type=True), *frames]


def _legit_run(ctl, executors) -> list:
    a, b = executors
    moved = ctl.submit("identity", ctl.put([1, 2, 3], executor=a.id), executor=b.id)
    streamed = ctl.submit("countdown", config={"count": 5}, executor=b.id, on_part=lambda p: 0)
    return [*(ctl.submit("identity", i).result(timeout=30) for i in range(8)),
            moved.result(timeout=30), streamed.result(timeout=30)]


def _rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) >> 10


def _insider(ctl):
    """A client that joined with the run's secret: it may speak, for itself only."""
    sock = dealer(ctl.address, secret=ctl.secret)
    sock.send_multipart(encode(Msg.HELLO, {"name": "insider", "tags": [], "ops": ["noop"],
                                           "pid": 1, "secret": ctl.secret.hex()}))
    assert sock.poll(10_000), "the insider got no WELCOME"
    assert decode(sock.recv_multipart())[0]["t"] == Msg.WELCOME
    return sock


def _with_tag(tag: str, message: list[bytes]) -> list[bytes]:
    """The message as an insider peer sends it: its DATA or OBJECTS carries the run's peer
    tag."""
    try:
        header = msgpack.unpackb(message[0], raw=False, strict_map_key=False)
    except Exception:
        return message
    if not isinstance(header, dict) or header.get("t") not in (Msg.DATA, Msg.OBJECTS):
        return message
    return [msgpack.packb({**header, "auth": tag}, use_bin_type=True), *message[1:]]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_random_messages_crash_nothing_and_the_run_goes_on():
    with executor_cluster(2) as (ctl, executors):
        baseline = _legit_run(ctl, executors)
        pids = [os.getpid(), *(process_of(ctl, e).pid for e in executors)]
        before = [_rss_mib(pid) for pid in pids]
        tag = peer_tag(ctl.secret)
        # past the gate (a stranger's connection is dropped in its handshake): without a
        # HELLO, an insider, a peer without the run's tag and one with it
        senders = [(dealer(ctl.address, secret=ctl.secret), None), (_insider(ctl), None),
                   (dealer(executors[1].peer_address, secret=ctl.secret), None),
                   (dealer(executors[1].peer_address, secret=ctl.secret), tag)]

        @settings(max_examples=300, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(_messages())
        def fuzz(message):
            for sock, peer in senders:
                sock.send_multipart(message if peer is None else _with_tag(peer, message))

        fuzz()
        assert _legit_run(ctl, executors) == baseline
        assert {e.name for e in ctl.executors()} == {"exec-0", "exec-1", "insider"}
        assert all(process_of(ctl, e).poll() is None for e in executors)
        grown = [_rss_mib(pid) - was for pid, was in zip(pids, before)]
        assert max(grown) < 200, f"memory grew by {grown} MiB"
        for sock, _ in senders:
            sock.close()
    for module in ("antigravity", "venv.__main__", "subprocess_rogue"):
        assert module not in sys.modules
