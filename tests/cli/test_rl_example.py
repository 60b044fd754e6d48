"""The RL example end to end, as the README runs it: a supervised warm-up saved as a checkpoint,
then GRPO from it on torch executors; the mean reward rises clearly and the metrics carry the
reward, the response length and per-node timings."""

import json
import os
import statistics
from pathlib import Path

from click.testing import CliRunner

from flowkit.cli import main

EXAMPLES = Path(__file__).parents[2] / "examples"


def test_grpo_on_digit_sorting_raises_the_mean_reward(tmp_path):
    runner = CliRunner()
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the example reads checkpoints/actor.pt from the working directory
    try:
        warm = runner.invoke(main, ["run", str(EXAMPLES / "sort_sft.py"), "--steps", "600",
                                    "--save-weights", "checkpoints", "--no-dashboard"])
        assert warm.exit_code == 0, warm.output
        assert (tmp_path / "checkpoints" / "actor.pt").is_file()
        rl = runner.invoke(main, ["run", str(EXAMPLES / "grpo_sort.py"), "--steps", "30",
                                  "--metrics", "grpo.jsonl", "--no-dashboard"])
        assert rl.exit_code == 0, rl.output
    finally:
        os.chdir(cwd)
    assert "executors: torch" in rl.output
    lines = [json.loads(line) for line in (tmp_path / "grpo.jsonl").read_text().splitlines()]
    assert all({"step", "reward_mean", "response_length_mean", "timing_s/generate",
                "timing_s/update_actor"} <= set(line) for line in lines)
    rewards = [line["reward_mean"] for line in lines]
    assert rewards[0] < 0.3
    assert statistics.fmean(rewards[-5:]) > 0.7, rewards
