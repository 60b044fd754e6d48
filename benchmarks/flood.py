"""`flowkit bench flood --seconds 60`: a flood against a running run, the figures of issue 53's
judgement. A raw DEALER sends 1-byte frames (or DONEs) as fast as it can, or at `--rate`
messages a second, and never reads, to the run's controller or to an executor's data socket:
a stranger's (`--who stranger`, no password: its gate drops each connection in the handshake,
[Note: strangers stop at the handshake] in flowkit/wire/auth.py), or one past the gate
(`--who past-gate`: the run's transport password, no HELLO, so its messages fill its queue
there and are refused one by one); meanwhile the run (a controller process of its own and two
executors, their log in one file) does rounds of 200 tasks and 20 values moved between its
executors. Reported: the controller's RSS growth (at its peak and at the end) and its log's
growth over the flood, the messages sent and the answers the stranger got, the median round
before and under the flood. tests/security/test_floods.py floods for 5 s."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import zmq

from flowkit.wire.auth import plain_client
from flowkit.wire.protocol import Msg, encode

ROOT = Path(__file__).resolve().parents[1]

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

FRAMES = {"1-byte": [b"x"], "done": encode(Msg.DONE, {"items": []})}


class Run:
    """A run of a controller process and two executors, its log in `log`; `env` added to the
    processes' environment."""

    def __init__(self, log: Path, **env: str) -> None:
        env = {**os.environ, **env}  # cwd=ROOT puts the checkout on its path (python -c)
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
        assert answer["got"] == [*range(20), *range(tasks)], "the run's results changed"
        return answer["s"]

    def rss_mib(self, pid: int | None = None, field: str = "VmRSS") -> float:
        """The controller's RSS (or `field`: VmHWM, its peak), or process `pid`'s."""
        with open(f"/proc/{pid or self.process.pid}/status") as status:
            line = next(line for line in status if line.startswith(f"{field}:"))
        return int(line.split()[1]) / 1024

    def log_bytes(self) -> int:
        return self.log.stat().st_size

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(30)


@contextmanager
def flood(address: str, frames: list[bytes], rate: float = 0.0, secret: bytes | None = None
          ) -> Iterator[dict]:
    """A thread sends `frames` as one message, over and over (at most `rate` a second, when
    given), to `address` and never reads, with the transport password of the run of `secret`
    when given; the dict counts the messages sent, and once it ends the answers that came."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 100)  # past the receiver's mark: try again, not hang
    if secret is not None:
        plain_client(sock, secret)
    sock.connect(address)
    stop, sent = threading.Event(), {"messages": 0, "answers": 0}

    def send() -> None:
        start = time.monotonic()
        while not stop.is_set():
            if rate and sent["messages"] >= rate * (time.monotonic() - start):
                time.sleep(0.001)
                continue
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


def under_flood(run: Run, address: str, frames: list[bytes], seconds: float,
                rate: float = 0.0, who: str = "stranger") -> dict:
    """Rounds of the run's work before and during a flood of `seconds` by `who` (stranger or
    past-gate): the figures of the bound."""
    secret = bytes.fromhex(run.addresses["secret"]) if who == "past-gate" else None
    before = [run.round() for _ in range(5)]
    rss, log = run.rss_mib(), run.log_bytes()
    rounds, peak = [], 0.0
    with flood(address, frames, rate, secret) as sent:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            rounds.append(run.round())
            peak = max(peak, run.rss_mib() - rss)
    return {"who": who, "seconds": seconds, "sent": sent["messages"], "answers": sent["answers"],
            "log_bytes": run.log_bytes() - log, "rss_mib": run.rss_mib() - rss,
            "rss_peak_mib": peak, "round_s": statistics.median(before),
            "flooded_round_s": statistics.median(rounds), "rounds": len(rounds),
            "slowdown": statistics.median(rounds) / statistics.median(before)}


def run_flood_bench(seconds: float = 60.0, target: str = "controller", kind: str = "1-byte",
                    rate: float = 0.0, who: str = "stranger") -> dict:
    with tempfile.TemporaryDirectory(prefix="flowkit-flood-") as folder:
        run = Run(Path(folder) / "run.log")
        try:
            for _ in range(3):  # warm: imports, first tasks
                run.round()
            address = run.addresses["address" if target == "controller" else "peer"]
            figures = under_flood(run, address, FRAMES[kind], seconds, rate, who)
        finally:
            run.close()
    return {"target": target, "frames": kind, "rate": rate or "unthrottled", **figures}
