"""An insider (a client that joined with the run's secret) sends a STREAMS message of 10^6
bodies, and one of 10^6 outputs nested under the per-array limit, and a DONE of each kind:
the controller, a process of its own, refuses each one (an ERROR back), before it has built
the whole, its memory stays bounded, and the run goes on to its results ([Note: header limits]
and [Note: header totals] in flowkit/wire/protocol.py)."""

from __future__ import annotations

from collections.abc import Iterator

import msgpack
import pytest

from benchmarks.flood import Run
from flowkit.wire.protocol import PROTOCOL_VERSION, Msg, decode, encode
from tests.harness import dealer

_BODY = {"task": 1, "index": 0, "outputs": [{"id": 1, "nbytes": 0}]}
_OUTPUTS = [{"id": 1, "nbytes": 0}] * 125_000
_HEADERS = {
    "streams-flat": {"t": Msg.STREAMS, "end": 1.0, "tasks": [_BODY] * 1_000_000},
    "streams-nested": {"t": Msg.STREAMS, "end": 1.0,
                       "tasks": [{"task": 1, "index": 0, "outputs": _OUTPUTS}] * 8},
    "done-flat": {"t": Msg.DONE, "items": [{"task": 1, "ok": True}] * 1_000_000},
    "done-nested": {"t": Msg.DONE, "items": [{"task": 1, "ok": True, "outputs": _OUTPUTS}] * 8},
}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Iterator[Run]:
    started = Run(tmp_path_factory.mktemp("insider") / "run.log")
    started.round()
    yield started
    started.process.stdin.close()
    started.process.wait(30)


@pytest.fixture(scope="module")
def insider(run):
    sock = dealer(run.addresses["address"], secret=bytes.fromhex(run.addresses["secret"]))
    sock.send_multipart(encode(Msg.HELLO, {"name": "insider", "tags": [], "ops": ["noop"],
                                           "pid": 1, "secret": run.addresses["secret"]}))
    assert sock.poll(10_000), "the insider got no WELCOME"
    assert decode(sock.recv_multipart())[0]["t"] == Msg.WELCOME
    yield sock
    sock.close()


@pytest.mark.parametrize("name", list(_HEADERS))
def test_an_insiders_million_bodies_are_refused_and_the_controller_stays_bounded(
        run, insider, name):
    header = msgpack.packb({"v": PROTOCOL_VERSION, **_HEADERS[name]})
    peak, rss = run.rss_mib(field="VmHWM"), run.rss_mib()
    insider.send(header)
    assert insider.poll(10_000), "no answer"
    answer = decode(insider.recv_multipart())[0]
    figures = {"frame_mib": len(header) / 2**20, "peak_mib": run.rss_mib(field="VmHWM") - peak,
               "rss_mib": run.rss_mib() - rss, "reason": answer.get("reason", "")[:90]}
    print(name, figures)
    assert answer["t"] == Msg.ERROR
    assert "exceeds max_array_len" in answer["reason"] or "objects" in answer["reason"]
    assert figures["peak_mib"] < 256, figures  # was 599 MiB held, a 1.08 GB peak
    assert figures["rss_mib"] < 64, figures
    run.round()
