"""A stranger's flood: a raw DEALER without the run's secret sends 1-byte frames for seconds
and never reads, to a run's controller and to an executor's data socket. The run (a controller
process of its own, its log in a file) goes on to the right results; its log grows by a few
lines, not one a message; its memory stays bounded; the stranger hears nothing back
[Note: refusals in flowkit/wire/refusals.py]."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq

from flowkit.wire.protocol import Msg, encode
from tests.harness import dealer

ROOT = Path(__file__).resolve().parents[2]
FLOOD_S = 5.0

# The run under attack: a controller and two executors (their stderr is the controller's, so
# the one log file holds all three processes' lines). Each line on stdin asks for a round of
# tasks, values moved between the executors included; it answers the results and the seconds.
_DRIVER = textwrap.dedent("""
    import json, logging, sys, time
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from flowkit.runtime import Controller, LocalExecutors
    with Controller() as ctl, LocalExecutors(ctl, 2) as infos:
        a, b = sorted(infos, key=lambda e: e.name)
        print(json.dumps({"address": ctl.address, "peer": b.peer_address, "peer_pid": b.pid,
                          "secret": ctl.secret.hex()}), flush=True)
        for line in sys.stdin:
            start = time.perf_counter()
            moved = [ctl.submit("identity", ctl.put(i, executor=a.id), executor=b.id)
                     for i in range(20)]
            tasks = [ctl.submit("identity", i) for i in range(int(line))]
            got = [f.result(timeout=60) for f in moved + tasks]
            print(json.dumps({"got": got, "s": time.perf_counter() - start}), flush=True)
""")


class Run:
    def __init__(self, log: Path, **env: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
        self.log = log
        self.process = subprocess.Popen(
            [sys.executable, "-c", _DRIVER], cwd=ROOT, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"))
        self.addresses = json.loads(self.process.stdout.readline())

    def round(self, tasks: int = 200) -> float:
        """A round of the run's work; its seconds, once its results are checked."""
        self.process.stdin.write(f"{tasks}\n")
        self.process.stdin.flush()
        answer = json.loads(self.process.stdout.readline())
        assert answer["got"] == [*range(20), *range(tasks)]
        return answer["s"]

    def rss_mib(self, pid: int | None = None, field: str = "VmRSS") -> float:
        """The controller's RSS (or `field`: VmHWM, its peak), or process `pid`'s."""
        with open(f"/proc/{pid or self.process.pid}/status") as status:
            line = next(line for line in status if line.startswith(f"{field}:"))
        return int(line.split()[1]) / 1024

    def log_bytes(self) -> int:
        return self.log.stat().st_size


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Iterator[Run]:
    started = Run(tmp_path_factory.mktemp("flood") / "run.log")
    for _ in range(3):  # warm: imports, first tasks
        started.round()
    yield started
    started.process.stdin.close()
    started.process.wait(30)


@contextmanager
def flood(address: str, frames: list[bytes]) -> Iterator[dict]:
    """A thread sends `frames` as one message, over and over, to `address` and never reads;
    the dict counts the messages sent."""
    sock, stop, sent = dealer(address), threading.Event(), {"messages": 0, "answers": 0}
    sock.setsockopt(zmq.SNDTIMEO, 100)  # past the receiver's mark: try again, not hang

    def send() -> None:
        while not stop.is_set():
            try:
                sock.send_multipart(frames)
                sent["messages"] += 1
            except zmq.Again:
                pass

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    try:
        yield sent
    finally:
        stop.set()
        thread.join(5)
        while sock.poll(200):  # what it was sent meanwhile, read only now
            sock.recv_multipart()
            sent["answers"] += 1
        sock.close()


def _under_flood(run: Run, address: str, frames: list[bytes]) -> dict:
    """Rounds of the run's work before and during a flood: the figures of the bound."""
    before = min(run.round() for _ in range(3))
    rss, log = run.rss_mib(), run.log_bytes()
    rounds = []
    with flood(address, frames) as sent:
        deadline = time.monotonic() + FLOOD_S
        while time.monotonic() < deadline:
            rounds.append(run.round())
    figures = {"sent": sent["messages"], "answers": sent["answers"],
               "log_bytes": run.log_bytes() - log, "rss_mib": run.rss_mib() - rss,
               "round_s": before, "flooded_round_s": sorted(rounds)[len(rounds) // 2]}
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
