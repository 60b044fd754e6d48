"""The recipes as flows (dataflows/recipes.py) and the ops and settings they add: Dr. GRPO's
unscaled advantages and DAPO's overlong penalty against verl, the knobs a recipe gives the
actor's Backprop, and the settings that cannot go together refused before anything starts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dataflows.grpo import grpo_flow
from dataflows.model_ops import Backprop, OptimizerStep
from dataflows.ppo import ppo_flow
from dataflows.recipes import dapo_flow, dr_grpo_flow, gspo_flow
from dataflows.rl.ops import arithmetic_prompts, grpo_advantages, overlong_penalty
from flowkit.dsl import Flow, FlowError, Model, collect
from flowkit.ops.records import Scored
from tests.rl import reference_algos as algos

FAST = settings(max_examples=40, deadline=None)
ACTOR = Model(name="actor", build="m:M")


def _scored(reward: float, length: int, sample: int = 0) -> Scored:
    return Scored(prompt_id=0, sample=sample, prompt_tokens=[1], response_tokens=[5] * length,
                  logprobs=[0.0] * length, reward=reward)


def _verl_overlong(valid_response_length, max_resp_len, overlong_buffer_len, penalty_factor):
    """verl's DAPO reward manager's overlong shaping."""
    expected_len = max_resp_len - overlong_buffer_len
    exceed_len = valid_response_length - expected_len
    return min(-exceed_len / overlong_buffer_len * penalty_factor, 0)


# -- the ops ------------------------------------------------------------------------------------
@FAST
@given(budget=st.integers(1, 64), data=st.data(), factor=st.floats(0.0, 2.0),
       reward=st.floats(-1.0, 1.0))
def test_the_overlong_penalty_is_verls(budget, data, factor, reward):
    buffer = data.draw(st.integers(1, budget))
    length = data.draw(st.integers(0, budget))
    got = overlong_penalty.fn(_scored(reward, length), max_new_tokens=budget, buffer=buffer,
                              penalty_factor=factor)
    assert got.reward == pytest.approx(reward + _verl_overlong(length, budget, buffer, factor),
                                       abs=1e-12)


def test_the_overlong_penalty_ramps_over_the_buffer():
    rewards = [overlong_penalty.fn(_scored(1.0, n), max_new_tokens=10, buffer=4).reward
               for n in (6, 7, 8, 10)]
    assert rewards == [1.0, 0.75, 0.5, 0.0]


@FAST
@given(rewards=st.lists(st.floats(-2.0, 2.0), min_size=1, max_size=8))
def test_dr_grpo_advantages_are_verls_without_the_std(rewards):
    group = [_scored(r, 3, sample=i) for i, r in enumerate(rewards)]
    got = [e.advantages for e in grpo_advantages.fn(group, scale_rewards=False)]
    token_rewards = torch.zeros(len(rewards), 3, dtype=torch.float64)
    token_rewards[:, -1] = torch.tensor(rewards, dtype=torch.float64)
    want = algos.grpo_advantages(token_rewards, torch.ones_like(token_rewards),
                                 [0] * len(rewards), norm_by_std=False)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=0, atol=1e-9)


def test_filter_groups_drops_a_group_whose_rewards_are_all_equal():
    def advantages(rewards, **config):
        group = [_scored(r, 2, sample=i) for i, r in enumerate(rewards)]
        return list(grpo_advantages.fn(group, filter_groups=True, **config))

    assert advantages([1.0, 1.0, 1.0]) == [] and advantages([0.0, 0.0]) == []
    assert len(advantages([1.0, 0.0, 1.0])) == 3
    assert len(advantages([0.5])) == 1  # a group of one has nothing to be equal to (verl)


def test_dynamic_sampling_generates_more_prompts_and_takes_the_batch():
    flow = dapo_flow(prompts=4, max_new_tokens=10).validate()
    # filter_oversample 2: 8 prompts a round, for each of 3 rounds
    assert flow.nodes["arithmetic_prompts"].config["count"] == 8 * 3
    (wire,) = [w for w in flow.wires if w.dst == "grpo_advantages"]
    assert (wire.adapter.size, wire.adapter.take, wire.adapter.rounds) == (8, 4, 3)
    assert flow.nodes["grpo_advantages"].config["filter_groups"] is True
    with pytest.raises(ValueError, match="n=1"):
        grpo_flow(filter_groups=True, n=1)
    with pytest.raises(ValueError, match="use one of them"):
        grpo_flow(filter_groups=True, oversample=1.5, max_staleness=1)


# -- the recipes --------------------------------------------------------------------------------
def _actor_config(flow: Flow) -> dict:
    return flow.validate().nodes["update_actor"].config


def test_dapo_sets_clip_higher_the_token_loss_and_a_fifth_of_the_budget_as_buffer():
    flow = dapo_flow(prompts=4, max_new_tokens=20)
    config = _actor_config(flow)
    assert (config["clip_ratio_low"], config["clip_ratio_high"], config["clip_ratio_c"],
            config["loss_agg_mode"], config["kl_coef"]) == (0.2, 0.28, 10.0, "token-mean", 0.0)
    assert flow.nodes["overlong_penalty"].config == {"max_new_tokens": 20, "buffer": 4,
                                                     "penalty_factor": 1.0}
    # no KL term: no reference model, no reference log-probs
    assert list(flow.models) == ["actor"] and "ref_logprobs" not in flow.nodes


def test_a_shortcut_overrides_the_recipes_setting():
    flow = dapo_flow(max_new_tokens=20, clip_ratio_high=0.3, overlong_buffer=2, kl_coef=0.01)
    config = _actor_config(flow)
    assert config["clip_ratio_high"] == 0.3 and config["kl_coef"] == 0.01
    assert flow.nodes["overlong_penalty"].config["buffer"] == 2
    assert "reference" in flow.models  # a KL term brings the reference back


def test_dr_grpo_divides_by_the_budget_and_leaves_out_the_std():
    flow = dr_grpo_flow(max_new_tokens=12)
    config = _actor_config(flow)
    assert (config["loss_agg_mode"], config["loss_scale_factor"]) == (
        "seq-mean-token-sum-norm", 12)
    assert flow.nodes["grpo_advantages"].config["scale_rewards"] is False


def test_gspo_takes_the_sequence_ratio_with_its_own_clip_range():
    config = _actor_config(gspo_flow())
    assert (config["policy_loss"], config["clip_ratio_low"], config["clip_ratio_high"],
            config["loss_agg_mode"]) == ("gspo", 3e-4, 4e-4, None)


def test_the_policy_knobs_are_shortcuts_of_every_rl_flow():
    config = _actor_config(ppo_flow(entropy_coeff=0.01, rollout_is="token", mask_truncated=True))
    assert (config["entropy_coeff"], config["rollout_is"], config["mask_truncated"]) == (
        0.01, "token", True)
    assert _actor_config(grpo_flow())["loss_agg_mode"] is None  # the policy loss's own


# -- settings that cannot go together ------------------------------------------------------------
def _backprop_problems(**config) -> list:
    with pytest.raises(FlowError) as raised:
        with Flow("f"):
            stats = Backprop(ACTOR)(arithmetic_prompts(), microbatches=1, loss="grpo", **config)
            OptimizerStep(ACTOR)(collect(stats))
    return raised.value.problems


@pytest.mark.parametrize("config, port, words", [
    ({"policy_loss": "gspo", "loss_agg_mode": "token-mean"}, "loss_agg_mode",
     "seq-mean-token-mean"),
    ({"loss_agg_mode": "seq-mean-token-sum-norm"}, "loss_scale_factor", "a constant"),
    ({"rollout_is": "token", "epochs": 2}, "rollout_is", "one optimizer step"),
    ({"mask_truncated": "yes"}, "mask_truncated", "not True or False"),
    ({"clip_ratio_low": 1.5}, "clip_ratio_low", "out of range"),
    ({"rollout_is_threshold": 0.5}, "rollout_is_threshold", "out of range"),
    ({"loss_agg_mode": "token_mean"}, "loss_agg_mode", "not one the executors implement"),
    ({"policy_loss": "gpso"}, "policy_loss", "not one the executors implement"),
])
def test_a_bad_loss_setting_is_a_problem_before_anything_runs(config, port, words):
    (problem,) = _backprop_problems(**config)
    assert problem.port == port and words in problem.message, problem


def test_a_typo_in_a_choice_gets_a_suggestion():
    (problem,) = _backprop_problems(loss_agg_mode="token_mean")
    assert "token-mean" in problem.fix


def test_grpos_own_settings_and_a_recipes_config_record_are_refused():
    from dataflows.rl.config import GroupRLConfig
    from dataflows.rloo import rloo_flow

    with pytest.raises(ValueError, match="filter_groups: GRPO's settings"):
        rloo_flow(filter_groups=True)
    with pytest.raises(ValueError, match="scale_rewards=False"):
        rloo_flow(scale_rewards=False)
    with pytest.raises(TypeError, match="dapo_flow takes the recipe's settings"):
        dapo_flow(GroupRLConfig(prompts=4))


def test_dynamic_sampling_filters_on_the_task_reward_not_the_shaped_one():
    # all right, one response in the overlong buffer: shaped rewards differ, accuracy does not
    shaped = [overlong_penalty.fn(_scored(1.0, length, sample=i), max_new_tokens=10, buffer=2)
              for i, length in enumerate((4, 4, 10))]
    assert [s.reward for s in shaped] == [1.0, 1.0, 0.0]
    assert [s.task_reward for s in shaped] == [1.0, 1.0, 1.0]
    assert list(grpo_advantages.fn(shaped, filter_groups=True)) == []
    assert len(list(grpo_advantages.fn(shaped))) == 3  # unfiltered, it trains on the lengths


def test_an_overlong_buffer_beyond_the_budget_is_refused_when_the_flow_is_built():
    with pytest.raises(ValueError, match="overlong_buffer=40 with max_new_tokens=8"):
        grpo_flow(max_new_tokens=8, overlong_buffer=40)


# -- a step's loss and values over its microbatches ------------------------------------------------
def test_a_steps_loss_is_the_summed_losses_over_the_summed_normalizers():
    from flowkit.ops.records import MicrobatchStats, mean_loss, mean_values

    # seq-mean modes: the normalizer counts responses, not tokens
    stats = [MicrobatchStats(loss=2.0, tokens=10, normalizer=1.0,
                             values={"entropy": 1.0, "rollout_is/max": 1.5}),
             MicrobatchStats(loss=5.0, tokens=2, normalizer=3.0,
                             values={"entropy": 4.0, "rollout_is/max": 1.2}),
             MicrobatchStats(loss=0.0, tokens=0, normalizer=0.0, values={"entropy": 99.0})]
    assert mean_loss(stats) == (pytest.approx((2.0 * 1 + 5.0 * 3) / 4), 12)
    values = mean_values(stats)
    assert values["entropy"] == pytest.approx((1.0 * 10 + 4.0 * 2) / 12)  # by tokens
    assert values["rollout_is/max"] == 1.5  # a largest stays the largest
    # a loss that is a mean already (lm) counts no normalizer: token-weighted as before
    lm = [MicrobatchStats(loss=1.0, tokens=3), MicrobatchStats(loss=3.0, tokens=1)]
    assert mean_loss(lm) == (pytest.approx(1.5), 4)


def test_the_multi_turn_flow_needs_an_environment_and_scores_by_it():
    from dataflows.envs import guess_prompts
    from dataflows.recipes import multi_turn_grpo_flow

    flow = multi_turn_grpo_flow(prompts=2, n=2, environment="dataflows.envs:GuessNumber",
                                prompt_source=guess_prompts, max_turns=3)
    assert "environment_reward" in flow.nodes
    assert flow.nodes["generate"].config["environment"] == "dataflows.envs:GuessNumber"
    assert flow.nodes["generate"].config["max_turns"] == 3
    programmed = multi_turn_grpo_flow(prompts=2, n=2, program="mypkg.agents:solve")
    assert programmed.nodes["generate"].config["program"] == "mypkg.agents:solve"
    with pytest.raises(ValueError, match="give environment="):
        multi_turn_grpo_flow(prompts=2, n=2)
