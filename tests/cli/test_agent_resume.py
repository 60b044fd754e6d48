"""Trajectories in flight across a checkpoint [Note: parked trajectories in
executors/torch/rollout/trajectories.py]: an asynchronous run with partial rollouts of the guessing
game checkpoints the trajectories it cut with their environments' state (Rollout.env_state), and
the run resumed from it loses none: every game started is trained once, dropped, or still
carried at the end, and no environment fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowkit.runner.checkpoints.format import read_run_state
from flowkit.runner.checkpoints.state_codec import allowed_records
from tests.cli.runs import FLOWS, conserved
from tests.cli.runs import metrics_lines as _lines
from tests.cli.runs import run_ok as _run

pytestmark = pytest.mark.slow  # end to end: runs that start their own executor processes

GUESS = str(FLOWS / "tiny_guess.py")
STEPS, STOP = 4, 2


def test_a_resumed_agent_run_loses_no_trajectory_in_flight(tmp_path: Path):
    common = ("--executors", "torch", "--max-staleness", "1", "--steps", str(STEPS))
    _run(GUESS, *common, "--metrics", str(tmp_path / "writer.jsonl"), "--checkpoint-dir",
         str(tmp_path / "ck"), "--checkpoint-every", "1", "--keep-checkpoints", "10")
    checkpoint = tmp_path / "ck" / f"step-{STOP:08d}"
    cut = [r for step in range(1, STEPS) for c in read_run_state(
        tmp_path / "ck" / f"step-{step:08d}", allowed_records()).open_work.carried
        for r in c.items if r.interrupted]
    assert cut and all(len(r.response_mask) == len(r.response_tokens) for r in cut)
    # cut between the game's steps: its state saved; mid-step: drawn again after the resume
    assert all(r.env_state is None or isinstance(r.env_state["env"]["secret"], int)
               for r in cut)
    assert any(r.env_state is not None for r in cut)
    _run(GUESS, *common, "--metrics", str(tmp_path / "resumed.jsonl"), "--resume",
         str(checkpoint))
    lines = _lines(tmp_path / "resumed.jsonl")
    assert [line["step"] for line in lines] == list(range(STEPS))
    conserved(lines)
    assert all(line["agent/env_error_fraction"] == 0 and line["staleness/max"] <= 1
               for line in lines)
