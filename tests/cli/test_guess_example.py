"""The multi-turn game example end to end, as its docstring runs it but shorter: a supervised
warm-up on a noisy demonstrator's games, then GRPO with the environment stepping on the
rollout executor [Note: multi-turn rollouts in flowkit/ops/environments.py]. What the game's
40 steps learn is measured in docs/rl.md (.53 -> .86); the calculator example's test checks
learning (tests/cli/test_calculator_example.py). Here: that the two commands run as written
and the steps report their trajectories."""

import json
from pathlib import Path

import pytest

from tests.cli.runs import run_ok_in

pytestmark = pytest.mark.slow  # end to end: runs that start their own executor processes

EXAMPLES = Path(__file__).parents[2] / "examples"


def test_the_guessing_game_example_runs_and_reports_its_trajectories(tmp_path):
    # the warm-up in one stage and one microbatch of 64, its rows packed (games are shorter
    # than the length they are padded to): its gradients in less CPU time
    run_ok_in(tmp_path, str(EXAMPLES / "guess_sft.py"), "--steps", "100", "--stages", "1",
              "--microbatches", "1", "--packing", "--save-weights", "checkpoints")
    output = run_ok_in(tmp_path, str(EXAMPLES / "guess_grpo.py"), "--steps", "4", "--metrics",
                       "guess.jsonl", "--eval-every", "2")
    assert "executors: torch" in output
    lines = [json.loads(line) for line in (tmp_path / "guess.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(4))
    for line in lines:
        assert 1 <= line["agent/turns_mean"] <= 3 and line["agent/turns_max"] <= 3
        assert line["agent/env_error_fraction"] == 0 and line["agent/env_tokens_mean"] > 0
        assert 0 < line["reward_mean"] < 1  # some games won, not all: the warm-up's
    assert [line["step"] for line in lines if "eval/pass@1" in line] == [1, 3]
