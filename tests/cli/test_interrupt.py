"""Ctrl-C during `flowkit run`: the run stops, says where, writes the weights it was asked for,
exits 130 and leaves no executor behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from flowkit.runtime.forkserver import without_shared_server
from tests.cli.runs import default_sigint

pytestmark = pytest.mark.slow  # end to end: runs that start their own executor processes

ROOT = Path(__file__).resolve().parents[2]


def _processes_of(mark: str) -> set[int]:
    """The processes whose environment carries `mark`: the run and the executors it started."""
    pids = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mark.encode() in (entry / "environ").read_bytes():
                pids.add(int(entry.name))
        except OSError:
            continue  # gone while we looked
    return pids


def _wait_for_two_steps(run: subprocess.Popen, metrics: Path) -> None:
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert run.poll() is None and time.monotonic() < deadline, run.stdout.read()
        time.sleep(0.2)


def test_ctrl_c_stops_the_run_writes_the_weights_and_exits_130(tmp_path):
    mark = f"FLOWKIT_TEST_RUN={uuid.uuid4().hex}"
    metrics, weights = tmp_path / "m.jsonl", tmp_path / "weights"
    run = subprocess.Popen(
        [sys.executable, "-m", "flowkit", "run", "examples/pretrain_pp.py", "--stages", "2",
         "--steps", "100000", "--no-dashboard", "--metrics", str(metrics),
         "--save-weights", str(weights)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # the run's own fork server (not the suite's), started with the run's environment:
        # it and the executors forked from it carry the mark
        env={**without_shared_server(),
             mark.split("=")[0]: mark.split("=")[1]},
        start_new_session=True,  # its own process group, as a terminal's foreground job
        preexec_fn=default_sigint)
    try:
        _wait_for_two_steps(run, metrics)
        assert len(_processes_of(mark)) >= 3  # the run and its two executors (and fork server)
    except BaseException:
        os.killpg(run.pid, signal.SIGKILL)  # a failed test leaves no run behind
        raise
    os.killpg(run.pid, signal.SIGINT)  # what Ctrl-C sends: the whole foreground group
    try:
        output, _ = run.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # say what it was doing: every thread's stack
        os.kill(run.pid, signal.SIGUSR1)
        time.sleep(2)
        os.killpg(run.pid, signal.SIGKILL)
        output, _ = run.communicate()
        pytest.fail(f"Ctrl-C did not stop the run within 60 s; its output and threads:\n"
                    f"{output[-8000:]}")
    assert run.returncode == 130, output
    assert "interrupted at step" in output and "Aborted" not in output
    assert (weights / "gpt.pt").is_file()
    assert _processes_of(mark) == set()
