"""Liveness that survives load [Note: liveness in flowkit/wire/liveness.py]: sound executors
are not lost because the machine is oversubscribed or the controller's Python threads are
held up by a huge message, and local executors die with a controller killed by SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flowkit.wire.protocol import Msg, encode
from tests.harness import dealer, process_of

ROOT = Path(__file__).resolve().parents[2]
RUN_S = 4.0  # how long each run keeps its executors busy under the load


@contextmanager
def busy_loops(count: int) -> Iterator[None]:
    """`count` processes spinning on the CPU (8 on this machine's 2 cores: 4x oversubscribed)."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def run_for(ctl, infos, seconds: float) -> int:
    """Tasks on each of the run's executors, one after the other, for `seconds`; how many
    rounds ran."""
    done, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        futures = [ctl.submit("identity", done, executor=e.id) for e in infos]
        assert [f.result(timeout=60) for f in futures] == [done] * len(futures)
        done += 1
    return done


def assert_all_alive(ctl, infos) -> None:
    alive = {e.id for e in ctl.executors()}
    assert all(info.id in alive for info in infos)
    assert all(process_of(ctl, info).poll() is None for info in infos)


def test_a_run_four_times_oversubscribed_finishes_with_every_executor_alive(start_cluster):
    ctl, infos = start_cluster(2)
    with busy_loops(4 * (os.cpu_count() or 2)):
        assert run_for(ctl, infos, RUN_S) > 0
        assert_all_alive(ctl, infos)


def test_a_run_receiving_a_64_mib_hello_finishes_with_every_executor_alive(start_cluster):
    ctl, infos = start_cluster(2)
    rogue = dealer(ctl.address, secret=ctl.secret)  # past the gate: the HELLO is decoded
    try:
        hello = {"name": "x" * (64 << 20), "tags": [], "ops": [], "pid": 1, "host": "h",
                 "host_id": "h", "device": "cpu", "resources": {},
                 "peer_address": "tcp://127.0.0.1:1"}
        rogue.send_multipart(encode(Msg.HELLO, hello))
        assert run_for(ctl, infos, RUN_S) > 0
        assert_all_alive(ctl, infos)
    finally:
        rogue.close(linger=0)


CONTROLLER = textwrap.dedent("""
    import sys, time
    from flowkit.runtime import Controller, LocalExecutors
    ctl = Controller()
    launcher = LocalExecutors(ctl, 2)
    launcher.start()
    print(" ".join(str(p.pid) for p in launcher.processes), flush=True)
    time.sleep(600)
""")


def gone(pid: int) -> bool:
    """Exited (reaped, or a zombie of whoever adopted it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def test_local_executors_die_with_a_controller_killed_by_sigkill():
    controller = subprocess.Popen([sys.executable, "-c", CONTROLLER], cwd=ROOT,
                                  stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in controller.stdout.readline().split()]
        assert len(pids) == 2 and not any(gone(pid) for pid in pids)
        controller.send_signal(signal.SIGKILL)
        controller.wait()
        deadline = time.monotonic() + 2.0
        while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(gone(pid) for pid in pids), "executors outlived their controller by 2 s"
    finally:
        controller.kill()
        controller.wait()
