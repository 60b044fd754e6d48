"""A controller killed with SIGKILL mid-run, while its executors move arrays through shared
memory: no segment of its executors is left in /dev/shm [Note: segments of a killed run in
executors/forkserver.py]. Executors forked by a fork server (the default) unlink their own as
they die with their launcher, within a second; those started as plain processes
(FLOWKIT_FORKSERVER=off) die by the kernel's SIGKILL and cannot: the next run's start removes
them (sweep_stale)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flowkit.runtime import Controller, LocalExecutors
from flowkit.wire.shm import SHM_DIR
from tests.security.test_liveness import gone

ROOT = Path(__file__).resolve().parents[2]

_RUN = textwrap.dedent("""
    import os, sys, numpy as np
    from flowkit.runtime import Controller, LocalExecutors
    ctl = Controller()
    launcher = LocalExecutors(ctl, 2)
    a, b = sorted(launcher.start(), key=lambda e: e.name)
    told = False
    while True:  # a run that moves 8 MiB arrays from a to b, until it is killed
        ctl.submit("identity", ctl.put(np.ones(1 << 20), executor=a.id),
                   executor=b.id).result(timeout=60)
        if not told:
            print(a.pid, b.pid, flush=True)
            told = True
""")


def segments_of(pids: list[int]) -> list[str]:
    return [name for name in os.listdir(SHM_DIR)
            if any(name.startswith(f"flowkit-{pid}-") for pid in pids)]


def killed_mid_run(forkserver: str | None) -> tuple[list[int], list[str]]:
    """Kill -9 a run's controller mid-run; (its executors' pids, their segments then)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("FLOWKIT_FORKSERVER", None)  # unset: the run's own server, that dies with it
    if forkserver is not None:
        env["FLOWKIT_FORKSERVER"] = forkserver
    run = subprocess.Popen([sys.executable, "-c", _RUN], cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = [int(pid) for pid in run.stdout.readline().split()]
        time.sleep(0.5)
        held = segments_of(pids)
        os.kill(run.pid, signal.SIGKILL)
        run.wait()
        return pids, held
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()


def test_a_killed_runs_forked_executors_leave_no_segment():
    pids, held = killed_mid_run(None)
    assert held, "the run moved nothing through shared memory"
    killed = time.monotonic()
    while segments_of(pids) and time.monotonic() < killed + 5.0:
        time.sleep(0.01)
    print({"held": held, "gone_after_s": time.monotonic() - killed})
    assert not segments_of(pids), "segments outlived their run by 5 s"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_killed_runs_plain_executors_segments_go_when_the_next_run_starts():
    pids, held = killed_mid_run("off")
    assert held, "the run moved nothing through shared memory"
    deadline = time.monotonic() + 5.0  # the executors die by the kernel's SIGKILL
    while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert segments_of(pids), "plain processes cannot unlink theirs: the sweep's part"
    with Controller() as ctl, LocalExecutors(ctl, 1):
        assert not segments_of(pids)
