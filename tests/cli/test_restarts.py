"""Executor restarts [Note: executor restarts in flowkit/runner/checkpoints/restarts.py]: `kill -9`
executors of a running `flowkit run --max-restarts` at random moments; the run replaces them,
replays from its newest checkpoint and ends with the parameters and the curve of the run without
faults (float64); without restarts, or past them, it fails with a clear error."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flowkit.runtime.forkserver import executor_processes
from tests.cli.runs import output_of, run_ok

pytestmark = pytest.mark.slow  # end to end: runs that start their own executor processes

FLOWS = Path(__file__).parent / "flows"
GRPO = str(FLOWS / "tiny_grpo.py")
PRETRAIN = str(FLOWS / "tiny_pretrain.py")
ROOT = Path(__file__).resolve().parents[2]


def _arguments(flow: str, folder: Path, *args: str, weights: bool = True) -> list[str]:
    """`flowkit run`'s on torch executors (a later --executors wins), writing metrics and,
    with `weights`, the final weights into `folder`."""
    save = ["--save-weights", str(folder / "w")] if weights else []
    return [flow, "--executors", "torch", "--metrics", str(folder / "m.jsonl"), *save, *args]


def _command(flow: str, folder: Path, *args: str, weights: bool = True) -> list[str]:
    """The `flowkit run` of _arguments as a process of its own (its executors forked by the
    suite's fork server, found by executor_processes through it)."""
    return [sys.executable, "-m", "flowkit", "run", "--no-dashboard",
            *_arguments(flow, folder, *args, weights=weights)]


def _clean_run(flow: str, folder: Path, *args: str, weights: bool = True) -> None:
    """The run of _arguments in this process: the run without faults to compare with."""
    run_ok(*_arguments(flow, folder, *args, weights=weights))


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _run_with_kills(flow: str, folder: Path, steps: int, *args: str, kills: int,
                    seed: int, first: int = 1, weights: bool = True) -> str:
    """Run the flow, `kill -9` a random executor `kills` times: each once the run has recorded
    a random number of steps (from `first`; 0: once the checkpoint before the first step is
    written) and a random moment more (in an op, a weight sync, a checkpoint being written),
    after the run has recovered from the kill before."""
    rng = random.Random(seed)
    # well before the end: a step can take 15 ms, and a kill after the last one is no test
    points = sorted(rng.sample(range(first, max(first + kills, steps - 6)), kills))
    process = subprocess.Popen(_command(flow, folder, "--steps", str(steps),
                                        "--checkpoint-dir", str(folder / "ck"), *args,
                                        weights=weights),
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    killed, deadline = 0, time.monotonic() + 300
    while process.poll() is None and killed < kills and time.monotonic() < deadline:
        lines = _lines(folder / "m.jsonl")
        recovered = killed == 0 or (lines and lines[-1].get("restarts") == killed)
        started = (folder / "ck" / "step-00000000").is_dir()
        if recovered and started and len(lines) >= points[killed]:
            time.sleep(rng.uniform(0.0, 0.03))
            pids = list(executor_processes(process.pid))
            if pids:
                os.kill(rng.choice(pids), signal.SIGKILL)
                killed += 1
        time.sleep(0.02)
    output = output_of(process, 300)
    assert process.returncode == 0, output
    assert killed == kills, f"the run ended before {kills} kills: {output}"
    return output


def _same_run(faulty: Path, clean: Path, *keys: str) -> None:
    """The same final parameters (each model's file) and the same curve, each step once."""
    files = sorted(p.name for p in (clean / "w").glob("*.pt"))
    assert files and sorted(p.name for p in (faulty / "w").glob("*.pt")) == files
    for name in files:
        first = torch.load(faulty / "w" / name, weights_only=True)
        second = torch.load(clean / "w" / name, weights_only=True)
        for key in second:
            torch.testing.assert_close(first[key], second[key], rtol=0, atol=1e-10)
    curve = [[line.get(k) for k in ("step", *keys)] for line in _lines(faulty / "m.jsonl")]
    reference = [[line.get(k) for k in ("step", *keys)] for line in _lines(clean / "m.jsonl")]
    assert [c[0] for c in curve] == list(range(len(reference)))  # each step once
    for got, want in zip(curve, reference):
        assert got == pytest.approx(want, abs=1e-9)


@pytest.mark.parametrize(("flow", "keys"), [(PRETRAIN, ("loss",)),
                                            (GRPO, ("loss", "reward_mean"))])
def test_killed_executors_are_replaced_and_the_run_ends_as_without_faults(tmp_path, flow, keys):
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    _clean_run(flow, clean, "--steps", "12")
    output = _run_with_kills(flow, faulty, 12, "--max-restarts", "3", kills=2,
                             seed=len(keys))
    assert output.count("lost (") == 2 and "restart 2 of 3" in output
    _same_run(faulty, clean, *keys)
    assert _lines(faulty / "m.jsonl")[-1]["restarts"] == 2


def test_an_executor_lost_in_the_first_step_is_replaced_and_nothing_is_trained_twice(tmp_path):
    """The survivors may have stepped their stage already: the reload rebuilds every model."""
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    _clean_run(PRETRAIN, clean, "--steps", "6")
    _run_with_kills(PRETRAIN, faulty, 6, "--max-restarts", "1", kills=1, seed=0, first=0)
    _same_run(faulty, clean, "loss")


def test_without_restarts_a_killed_executor_fails_the_run_with_a_clear_error(tmp_path):
    process = subprocess.Popen(_command(PRETRAIN, tmp_path, "--steps", "40"), cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not _lines(tmp_path / "m.jsonl") and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(list(executor_processes(process.pid))[0], signal.SIGKILL)
    output = output_of(process, 120)
    assert process.returncode == 1
    assert "was lost" in output and "Traceback" not in output


@pytest.mark.parametrize(("flow", "steps", "settings", "keys", "seed"), [
    (PRETRAIN, 10, ("--replicas", "2"), ("loss",), 5),
    (GRPO, 12, ("--weight-sync", "broadcast"), ("loss", "reward_mean"), 7)],
    ids=["replica-groups", "weight-groups"])
def test_a_killed_member_of_process_groups_is_replaced_and_its_groups_rebuilt(
        tmp_path, flow, steps, settings, keys, seed):
    """Two replicas of the 2-stage pipeline (4 executors), or weights by broadcast [Note:
    weights by broadcast in executors/torch/weight_broadcast.py]: a kill at a random moment (in
    a sync too) is recovered, a replacement joins new groups, and the run ends with the
    parameters of the run without faults."""
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    _clean_run(flow, clean, "--steps", str(steps), *settings)
    output = _run_with_kills(flow, faulty, steps, "--max-restarts", "1", *settings, kills=1,
                             seed=seed)
    assert output.count("lost (") == 1
    _same_run(faulty, clean, *keys)
