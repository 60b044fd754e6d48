"""The multi-turn example end to end, as its docstring runs it: a supervised warm-up on a noisy
demonstrator's games, then GRPO on the guessing game with the environment stepping on the
rollout executor [Note: multi-turn rollouts in flowkit/ops/environments.py]. Games are won more
often, and in fewer turns."""

import json
import statistics
from pathlib import Path

from tests.cli.runs import run_ok_in

EXAMPLES = Path(__file__).parents[2] / "examples"


def test_grpo_on_the_guessing_game_wins_more_games(tmp_path):
    run_ok_in(tmp_path, str(EXAMPLES / "guess_sft.py"), "--steps", "300", "--save-weights",
              "checkpoints")
    output = run_ok_in(tmp_path, str(EXAMPLES / "guess_grpo.py"), "--steps", "40", "--metrics",
                       "guess.jsonl")
    assert "executors: torch" in output
    lines = [json.loads(line) for line in (tmp_path / "guess.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(40))
    assert all(1 <= line["agent/turns_mean"] <= 3 and line["agent/turns_max"] <= 3
               and line["agent/env_error_fraction"] == 0 for line in lines)
    rewards = [line["reward_mean"] for line in lines]
    first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-10:])
    # measured 0.40 -> 0.57 and 0.40 -> 0.58 (docs/rl.md): a margin for float32's batching
    assert 0.25 < first < 0.55 and last > first + 0.08, rewards
    turns = [line["agent/turns_mean"] for line in lines]
    assert statistics.fmean(turns[-10:]) < statistics.fmean(turns[:5]), turns
