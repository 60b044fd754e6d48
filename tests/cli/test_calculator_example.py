"""The tool example end to end, a short version of its docstring's commands: a supervised
warm-up that calls the calculator in a quarter of its answers, then GRPO with the calculator
run by the ToolEnvironment on the rollout executor [Note: multi-turn rollouts in
flowkit/ops/environments.py]. The model learns to call it, and answers right more often."""

import json
import statistics
from pathlib import Path

import pytest

from tests.cli.runs import run_ok_in

pytestmark = pytest.mark.slow  # end to end: runs that start their own executor processes

EXAMPLES = Path(__file__).parents[2] / "examples"


def test_grpo_learns_to_call_the_calculator(tmp_path):
    # the docs' run warms up 800 steps and trains 40 (.35 -> .79); half of each here, the
    # warm-up in one stage and one microbatch of 64 (its gradients, in 60 % of the CPU time)
    run_ok_in(tmp_path, str(EXAMPLES / "calculator_sft.py"), "--steps", "400", "--stages", "1",
              "--microbatches", "1", "--save-weights", "checkpoints")
    run_ok_in(tmp_path, str(EXAMPLES / "calculator_grpo.py"), "--steps", "20", "--metrics",
              "calculator.jsonl")
    lines = [json.loads(line) for line in
             (tmp_path / "calculator.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(20))
    # the tool environment's counts, reported with each step: calls, and none failing
    calls = [line["agent/tool_calls_mean"] for line in lines]
    assert all(line["agent/tool_errors_mean"] < 0.05 for line in lines)
    assert statistics.fmean(calls[:3]) < 0.5 and statistics.fmean(calls[-5:]) > 0.8, calls
    rewards = [line["reward_mean"] for line in lines]
    # where it starts (the first two steps, before their updates tell) and where it ends:
    # measured .13 -> .65 (deterministic on a 2-core CPU)
    first, last = statistics.fmean(rewards[:2]), statistics.fmean(rewards[-5:])
    assert first < 0.35 and last > first + 0.15, rewards
