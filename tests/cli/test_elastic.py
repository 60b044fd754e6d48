"""Elastic runs [Note: elastic runs in flowkit/runner/elastic.py]: `kill -9` an executor of a
`flowkit run --elastic` that may not replace it; the run (pretraining, or a GRPO) goes on with
the executors left, on fewer replicas (or fewer stages), and ends with the parameters and the
curve of the run that stopped at that checkpoint and was resumed on the smaller layout
(float64, 1e-10). Settings an elastic run cannot work with are refused in one line before any
executor starts; an executor started by hand while the run waits takes the lost one's place
instead, and one started after it shrank grows it back at a checkpoint."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flowkit.runtime.forkserver import executor_processes, without_shared_server
from flowkit.wire.hello import SECRET_ENV
from tests.cli.runs import GRPO, PRETRAIN, metrics_lines, output_of, refused
from tests.cli.test_restarts import ROOT, _clean_run, _command, _lines

pytestmark = pytest.mark.slow  # end to end: runs that start their own executor processes

STEPS = 8


def _elastic_run_with_a_kill(flow: str, folder: Path, *layout: str, after: int
                             ) -> tuple[str, int]:
    """An elastic run (no restarts) of STEPS steps whose last executor is killed once `after`
    steps are recorded: its output and the checkpoint step it shrank from."""
    process = subprocess.Popen(
        _command(flow, folder, "--steps", str(STEPS), *layout, "--checkpoint-dir",
                 str(folder / "ck"), "--checkpoint-every", "1", "--elastic", "--elastic-wait",
                 "0.2"),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while len(_lines(folder / "m.jsonl")) < after and time.monotonic() < deadline:
        time.sleep(0.02)
    pids = sorted(executor_processes(process.pid))
    os.kill(pids[-1], signal.SIGKILL)
    output = output_of(process, 300)
    assert process.returncode == 0, output
    shrunk = re.search(r"no restart left: the run goes on from step-(\d+)", output)
    assert shrunk, output
    return output, int(shrunk.group(1))


def _switched_layout_run(flow: str, folder: Path, before: tuple[str, ...],
                         after: tuple[str, ...], at: int) -> None:
    """STEPS steps on `before` with a checkpoint each step, then the run resumed from step `at`
    on `after`: what the elastic run must end as."""
    _clean_run(flow, folder / "whole", "--steps", str(STEPS), *before, "--checkpoint-dir",
               str(folder / "ck"), "--checkpoint-every", "1", "--keep-checkpoints",
               str(STEPS + 1), weights=False)
    _clean_run(flow, folder, "--steps", str(STEPS), *after, "--resume",
               str(folder / "ck" / f"step-{at:08d}"))


@pytest.mark.parametrize(("flow", "before", "after"), [
    (PRETRAIN, ("--replicas", "2"), ("--stages", "2", "--replicas", "1")),  # 4 executors -> 3
    (PRETRAIN, ("--replicas", "1"), ("--stages", "1", "--replicas", "1")),  # 2 executors -> 1
    (GRPO, ("--replicas", "1"), ("--stages", "1", "--replicas", "1")),  # generation too
])
def test_a_lost_executor_not_replaced_shrinks_the_run_to_the_layout_left(tmp_path, flow,
                                                                         before, after):
    elastic, switched = tmp_path / "elastic", tmp_path / "switched"
    output, at = _elastic_run_with_a_kill(flow, elastic, *before, after=3)
    assert f"the run shrinks to {3 if before[1] == '2' else 1} executor" in output
    assert " ".join(after) in output
    _switched_layout_run(flow, switched, before, after, at)
    (weights,) = [p.name for p in (switched / "w").glob("*.pt")]
    got, want = torch.load(elastic / "w" / weights, weights_only=True), torch.load(
        switched / "w" / weights, weights_only=True)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-10)
    lines, reference = metrics_lines(elastic / "m.jsonl"), metrics_lines(switched / "m.jsonl")
    assert [line["step"] for line in lines] == list(range(STEPS))  # each step once
    for key in ("loss", "reward_mean"):  # the pretraining runs have no reward
        assert [line.get(key) for line in lines] == pytest.approx(
            [line.get(key) for line in reference], abs=1e-10)
    assert [line["shrinks"] for line in lines] == [0] * at + [1] * (STEPS - at)


@pytest.mark.parametrize(("flags", "says"), [
    ((), "give --checkpoint-dir and --checkpoint-every"),
    (("--checkpoint-dir", "CK"), "give --checkpoint-dir and --checkpoint-every"),
    (("--checkpoint-dir", "CK", "--checkpoint-every", "1", "--placement", "disaggregated"),
     "leave --tags and --placement out"),
])
def test_settings_an_elastic_run_cannot_work_with_are_refused_in_one_line(tmp_path, flags,
                                                                          says):
    flags = tuple(str(tmp_path / "ck") if flag == "CK" else flag for flag in flags)
    out = refused(PRETRAIN, "--executors", "torch", "--steps", "2", "--elastic", *flags)
    (line,) = [text for text in out.splitlines() if text.startswith("Error:")]
    assert "--elastic" in line and says in " ".join(out.split())
    assert not (tmp_path / "ck").exists()  # refused before anything started


def _start_by_hand(address: str, secret: Path) -> subprocess.Popen:
    """`flowkit executor` as a user starts one for the run: its kind, tags and flow code."""
    env = {k: v for k, v in without_shared_server().items() if k != SECRET_ENV}  # the file's
    return subprocess.Popen(
        [sys.executable, "-m", "executors", "--connect", address, "--name", "by-hand", "--kind",
         "torch", "--tags", "train", "--code", PRETRAIN, "--secret-file", str(secret)],
        cwd=ROOT, env=env, stdin=subprocess.DEVNULL)


def _same_as_clean(run: Path, clean: Path, steps: int) -> None:
    """The parameters and the curve of the run without faults, each step once."""
    got, want = torch.load(run / "w" / "gpt.pt", weights_only=True), torch.load(
        clean / "w" / "gpt.pt", weights_only=True)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-10)
    lines = _lines(run / "m.jsonl")
    assert [line["step"] for line in lines] == list(range(steps))
    assert [line["loss"] for line in lines] == pytest.approx(
        [line["loss"] for line in _lines(clean / "m.jsonl")], abs=1e-10)


def _killed_once(tmp_path: Path, steps: int, *, wait_s: float
                 ) -> tuple[subprocess.Popen, str, float]:
    """The clean run of `steps` in tmp_path/clean; then an elastic one in tmp_path/elastic
    (replicas 2, a checkpoint a step, its secret in tmp_path/secret), one of whose executors
    is killed after its third step: (its process, its address, the deadline to wait by)."""
    elastic, clean = tmp_path / "elastic", tmp_path / "clean"
    _clean_run(PRETRAIN, clean, "--steps", str(steps), "--replicas", "2")
    process = subprocess.Popen(
        _command(PRETRAIN, elastic, "--steps", str(steps), "--replicas", "2",
                 "--checkpoint-dir", str(elastic / "ck"), "--checkpoint-every", "1",
                 "--elastic", "--elastic-wait", f"{wait_s:g}",
                 "--secret-file", str(tmp_path / "secret")),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    address = re.search(r"--connect (\S+)", process.stdout.readline()).group(1)
    deadline = time.monotonic() + 120
    while len(_lines(elastic / "m.jsonl")) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(sorted(executor_processes(process.pid))[-1], signal.SIGKILL)
    return process, address, deadline


def _ends_with_one_by_hand(process: subprocess.Popen, address: str, secret: Path) -> str:
    """The output of the run of `process`, an executor started by hand joining it meanwhile;
    the run must end well."""
    by_hand = _start_by_hand(address, secret)
    try:
        output = output_of(process, 300)
    finally:
        by_hand.kill()
        by_hand.wait()
    assert process.returncode == 0, output
    return output


def test_an_executor_started_by_hand_in_the_wait_takes_the_lost_ones_place(tmp_path):
    """`flowkit executor --secret-file` started once an executor is lost: the run keeps its
    layout on it and ends with the parameters and the curve of the run without faults."""
    elastic, clean = tmp_path / "elastic", tmp_path / "clean"
    process, address, _ = _killed_once(tmp_path, STEPS, wait_s=60)
    output = _ends_with_one_by_hand(process, address, tmp_path / "secret")
    assert "took the lost ones' place: --stages 2 --replicas 2" in output
    _same_as_clean(elastic, clean, STEPS)
    assert _lines(elastic / "m.jsonl")[-1]["shrinks"] == 0


def test_a_shrunk_run_grows_back_at_a_checkpoint_when_an_executor_joins(tmp_path):
    """Shrunk to one replica, the run takes an executor started by hand at its next checkpoint
    after it joined, goes on with two again, and ends as the run without faults."""
    steps, elastic, clean = 80, tmp_path / "elastic", tmp_path / "clean"  # time to join
    process, address, deadline = _killed_once(tmp_path, steps, wait_s=0)
    while (not any(line.get("shrinks") for line in _lines(elastic / "m.jsonl"))
           and time.monotonic() < deadline):
        time.sleep(0.02)
    output = _ends_with_one_by_hand(process, address, tmp_path / "secret")
    assert "the run shrinks to 3 executors: --stages 2 --replicas 1" in output
    assert "the run grows to 4: --stages 2 --replicas 2" in output
    _same_as_clean(elastic, clean, steps)
    assert (_lines(elastic / "m.jsonl")[-1]["shrinks"], _lines(elastic / "m.jsonl")[-1]["grows"]
            ) == (1, 1)
