"""A stranger's flood: a raw DEALER without the run's secret sends 1-byte frames for seconds
and never reads, to a run's controller and to an executor's data socket. The run (a controller
process of its own, its log in a file) goes on to the right results; its log grows by a few
lines, not one a message; its memory stays bounded; the stranger hears nothing back
[Note: refusals in flowkit/wire/refusals.py]."""

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


def _under_flood(run: Run, address: str, frames: list[bytes]) -> dict:
    figures = under_flood(run, address, frames, FLOOD_S)
    print(figures)
    return figures


@pytest.mark.slow
@pytest.mark.parametrize("frames", [[b"x"], encode(Msg.DONE, {"items": []})],
                         ids=["1-byte", "done-without-hello"])
def test_a_strangers_flood_on_the_controller_is_bounded_and_unanswered(run, frames):
    figures = _under_flood(run, run.addresses["address"], frames)
    assert figures["sent"] > 10_000, figures  # a flood, not a trickle
    assert figures["answers"] == 0, figures
    assert figures["log_bytes"] < 4096, figures
    assert figures["rss_mib"] < 64, figures
    # two cores shared by the flooder, the controller and two executors: the run slows, and
    # goes on
    assert figures["flooded_round_s"] < 5 * figures["round_s"] + 0.5, figures


@pytest.mark.slow
def test_a_strangers_flood_on_an_executors_data_socket_is_bounded_and_unanswered(run):
    figures = _under_flood(run, run.addresses["peer"], [b"x"])
    assert figures["sent"] > 10_000, figures
    assert figures["answers"] == 0, figures
    assert figures["log_bytes"] < 4096, figures  # the executor's lines and the controller's
    assert figures["rss_mib"] < 64, figures
    assert figures["flooded_round_s"] < 5 * figures["round_s"] + 0.5, figures
