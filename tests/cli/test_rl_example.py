"""The RL examples end to end, as the README runs them: a supervised warm-up saved as a
checkpoint, then GRPO or PPO from it on torch executors; the mean reward rises clearly and the
metrics carry the reward, the response length and per-node timings."""

import json
import statistics
from pathlib import Path

import pytest

from tests.cli.runs import run_ok_in

pytestmark = pytest.mark.slow  # end to end: runs that start their own executor processes

EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.fixture(scope="module")
def warmed_up(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rl")
    # the README's 600 steps, in one stage and one microbatch of 64: the same gradients as its
    # 2 stages x 4 microbatches (the same loss to 1e-7; equal-length sequences), in half the
    # time; the pipelined runs are the RL ones
    run_ok_in(folder, str(EXAMPLES / "sort_sft.py"), "--steps", "600", "--stages", "1",
              "--microbatches", "1", "--save-weights", "checkpoints")
    assert (folder / "checkpoints" / "actor.pt").is_file()
    return folder


@pytest.mark.parametrize("example", ["grpo_sort.py", "ppo_sort.py", "grpo_sort.py:async_",
                                     "grpo_sort.py:partial"])
def test_rl_on_digit_sorting_raises_the_mean_reward(warmed_up, example):
    """Asynchronously too (`:async_`, `:partial`: one version of staleness, the decoupled
    objective, and with partial rollouts): learning as the synchronous run does."""
    evaluate = ["--eval-every", "5"] if example == "grpo_sort.py" else []
    output = run_ok_in(warmed_up, str(EXAMPLES / example), "--steps", "30", "--metrics",
                       f"{example}.jsonl", *evaluate)
    assert "executors: torch" in output
    lines = [json.loads(line) for line in (warmed_up / f"{example}.jsonl").read_text()
             .splitlines()]
    assert all({"step", "reward_mean", "response_length_mean", "timing_s/generate",
                "timing_s/update_actor"} <= set(line) for line in lines)
    rewards = [line["reward_mean"] for line in lines]
    assert rewards[0] < 0.3
    assert statistics.fmean(rewards[-5:]) > 0.7, rewards
    if evaluate:  # greedy on 64 held-out prompts after steps 4, 9, ..., 29: it learns too
        evals = [line for line in lines if "eval/pass@1" in line]
        assert [line["step"] for line in evals] == [4, 9, 14, 19, 24, 29]
        assert all(line["eval/prompts"] == 64 for line in evals)
        passed = [line["eval/pass@1"] for line in evals]
        # greedy decoding passes more than sampling does: after step 4 it has read 0.3-0.61
        # (a run's microbatches form in arrival order, so runs differ in their float sums)
        assert passed[-1] > 0.8 and passed[-1] - passed[0] >= 0.2, passed


def test_reinforce_pp_runs_on_torch_and_reports_rewards(warmed_up):
    """A short run (RLOO's flow runs on simulator executors in tests/runner): that it trains
    and reports; how far the reward rises is in the README."""
    output = run_ok_in(warmed_up, str(EXAMPLES / "reinforce_pp_sort.py"), "--steps", "2",
                       "--metrics", "reinforce_pp.jsonl")
    assert "executors: torch" in output
    lines = [json.loads(line) for line in (warmed_up / "reinforce_pp.jsonl").read_text()
             .splitlines()]
    assert [line["step"] for line in lines] == [0, 1]
    assert all(0 <= line["reward_mean"] <= 1 and "timing_s/update_actor" in line
               for line in lines)
