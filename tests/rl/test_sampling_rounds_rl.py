"""DAPO's dynamic sampling generating again [Note: sampling rounds in
flowkit/runner/sampling_rounds.py]: when the first round's groups all have equal rewards, a GRPO
step with filter_rounds generates the next round's prompts and trains exactly `prompts` groups,
every one with rewards that differ, counting the rounds it ran; an asynchronous flow with rounds is
refused when built."""

from __future__ import annotations

import pytest

import flowkit
from dataflows.recipes import dapo_flow
from flowkit import RunConfig
from flowkit.runner.config import RunConfigError
from tests.harness import pooled_run
from tests.torch.rl_ops import second_round_reward

SETTINGS = dict(prompts=4, n=4, microbatches=2, max_new_tokens=6, reward=second_round_reward)


@pytest.mark.parametrize("rounds, taken, ran", [(3, 4, 2), (1, 0, None)])
def test_a_short_first_round_generates_the_next(pool, rounds, taken, ran):
    """With 3 rounds the second fills the step; with 1 (no rounds) it trains nothing."""
    flow = dapo_flow(filter_rounds=rounds, **SETTINGS)
    result = pooled_run(pool, flow, RunConfig(steps=2, executors="sim", dashboard=False))
    for line in result.records:
        assert line["grpo_advantages/groups_taken"] == taken
        assert line["grpo_advantages/groups_empty"] == 8  # the first round's 8 groups
        assert line["grpo_advantages/groups_short"] == 4 - taken
        assert line.get("generate/sampling_rounds") == ran
        if ran:
            assert line["generate/prompts_unused"] == 8 * (rounds - ran)
        assert (line["update_actor/tokens"] > 0) == (taken > 0)  # one short round: nothing


def test_rounds_with_an_asynchronous_flow_are_refused_when_built():
    with pytest.raises(ValueError, match="filter_rounds=2 generates again within a step"):
        dapo_flow(filter_rounds=2, max_staleness=1, **SETTINGS)
    with pytest.raises(ValueError, match=r"filter_rounds=0"):
        dapo_flow(filter_rounds=0, **SETTINGS)


def test_an_asynchronous_run_of_a_flow_with_rounds_is_refused_before_it_starts():
    with pytest.raises(RunConfigError, match="runs synchronously only"):
        flowkit.run(dapo_flow(filter_rounds=2, **SETTINGS),
                    RunConfig(steps=1, executors="sim", dashboard=False, asynchronous=True,
                              max_staleness=1))
