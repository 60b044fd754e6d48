"""A flood: a raw DEALER sends 1-byte frames (or DONEs) for seconds and never reads, to a run's
controller and to an executor's data socket; a stranger's, dropped in each handshake [Note:
strangers stop at the handshake in flowkit/wire/auth.py], or one past the gate (the run's
transport password, no HELLO), whose messages fill its queue and are refused [Note: refusals
in flowkit/wire/refusals.py]. The run (a controller process of its own, its log in a file)
goes on to the right results; its log grows by a few lines, not one a message; its memory
stays bounded; the flooder hears nothing back. Past the gate, the flood's hang-up once aborted
the controller (libzmq's `!_io_error` assertion) while its servers sent ZMTP PINGs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from benchmarks.flood import Run, under_flood
from flowkit.wire.protocol import Msg, encode

FLOOD_S = 5.0  # `flowkit bench flood --seconds 60` is the long figure (docs/security.md)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Iterator[Run]:
    started = Run(tmp_path_factory.mktemp("flood") / "run.log")
    for _ in range(3):  # warm: imports, first tasks
        started.round()
    yield started
    started.close()


def _under_flood(run: Run, address: str, frames: list[bytes], who: str) -> dict:
    figures = under_flood(run, address, frames, FLOOD_S, who=who)
    print(figures)
    assert run.process.poll() is None, "the flood killed the run's controller"
    if who == "past-gate":
        assert figures["sent"] > 10_000, figures  # a flood, not a trickle
    else:  # no connection ever made: what it sent waits in its own queue
        assert figures["sent"] <= 1_000, figures
    return figures


@pytest.mark.slow
@pytest.mark.parametrize("frames, who", [([b"x"], "stranger"),
                                         (encode(Msg.DONE, {"items": []}), "past-gate")],
                         ids=["1-byte-stranger", "done-without-hello"])
def test_a_strangers_flood_on_the_controller_is_bounded_and_unanswered(run, frames, who):
    figures = _under_flood(run, run.addresses["address"], frames, who)
    assert figures["answers"] == 0, figures
    assert figures["log_bytes"] < 4096, figures
    assert figures["rss_mib"] < 64, figures
    # two cores shared by the flooder, the controller and two executors: the run slows, and
    # goes on
    assert figures["flooded_round_s"] < 5 * figures["round_s"] + 0.5, figures


@pytest.mark.slow
@pytest.mark.parametrize("who", ["stranger", "past-gate"])
def test_a_strangers_flood_on_an_executors_data_socket_is_bounded_and_unanswered(run, who):
    figures = _under_flood(run, run.addresses["peer"], [b"x"], who)
    assert figures["answers"] == 0, figures
    assert figures["log_bytes"] < 4096, figures  # the executor's lines and the controller's
    assert figures["rss_mib"] < 64, figures
    assert figures["flooded_round_s"] < 5 * figures["round_s"] + 0.5, figures
