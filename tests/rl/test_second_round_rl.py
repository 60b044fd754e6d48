"""DARS's second round in GRPO [Note: second rounds in flowkit/runner/second_round.py]: a prompt
whose first samples' rewards all agree is sampled again within the step, its group trains on
all of its samples when they then differ and is dropped when they still agree; the settings that
cannot work are refused when the flow is built or before the run starts. On simulator
executors."""

from __future__ import annotations

import pytest

import flowkit
from dataflows.grpo import grpo_flow
from dataflows.rl.adaptive import AdaptiveSampling
from dataflows.rloo import rloo_flow
from flowkit import RunConfig
from tests.harness import pooled_run
from tests.torch.rl_ops import easy_or_late_reward, late_sample_reward

SETTINGS = dict(prompts=4, n=4, microbatches=2, max_new_tokens=6, reward=late_sample_reward)


def _again(more: int = 4, budget: int | None = None, **settings) -> AdaptiveSampling:
    return AdaptiveSampling(**{"n_min": 4, "n_max": 4, "second_round": more,
                               "second_round_budget": budget, **settings})


@pytest.mark.parametrize("budget, again, kept", [(None, 4, 2), (0, 0, 0)])
def test_groups_that_agree_are_sampled_again_and_train_when_they_then_differ(pool, budget,
                                                                              again, kept):
    """Every prompt's 4 first samples agree; a second round of 4 makes the even prompts'
    groups differ (sample 5 passes), and they train on 8 samples each."""
    flow = grpo_flow(adaptive=_again(budget=budget), **SETTINGS)
    result = pooled_run(pool, flow, RunConfig(steps=2, executors="sim", dashboard=False))
    for line in result.records:
        assert line["generate/second_rounds"] == again
        assert line["generate/second_round_samples"] == 4 * again
        assert line["rollout/samples"] == 16 + 4 * again
        assert line["grpo_advantages/second_round_kept"] == kept
        assert line["grpo_advantages/second_round_denied"] == (4 if budget == 0 else 0)
        assert line["groups/zero_advantage_fraction"] == (0.5 if again else 1.0)
        assert (line["update_actor/tokens"] > 0) == bool(kept)


@pytest.mark.parametrize("when, again, samples", [("agree", 4, 32), ("fail", 2, 24)])
def test_a_second_round_when_they_fail_samples_again_only_the_prompts_none_solved(
        pool, when, again, samples):
    """The odd prompts' samples all pass, the even ones' all fail at first. "agree" samples
    all four again and drops the odd ones, which still agree; "fail" samples only the even
    ones again, and the odd ones train as they are (zero advantage)."""
    flow = grpo_flow(**{**SETTINGS, "reward": easy_or_late_reward},
                     adaptive=_again(second_round_when=when))
    result = pooled_run(pool, flow, RunConfig(steps=2, executors="sim", dashboard=False))
    for line in result.records:
        assert line["generate/second_rounds"] == again
        assert line["rollout/samples"] == samples
        assert line["grpo_advantages/second_round_kept"] == 2  # the even ones, with sample 5


def test_second_round_settings_that_cannot_work_are_refused_when_the_flow_is_built():
    cases = [
        (dict(adaptive=_again(), max_staleness=1), "samples again within a step, which runs "
         "synchronously only"),
        (dict(adaptive=_again(), oversample=1.5), "both decide which generation calls run"),
        (dict(adaptive=_again(more=-1)), "adaptive second_round=-1: a whole number"),
        (dict(adaptive=_again(budget=-2)), "adaptive second_round_budget=-2"),
        (dict(adaptive=_again(more=0, budget=8)), "second_round_budget=8 bounds a second "
         "round: give second_round too"),
        (dict(adaptive=_again(n_min=1)), "n_min=1 gives a prompt one sample"),
        (dict(adaptive=_again(second_round_when="hard")),
         "adaptive second_round_when='hard': one of agree, fail"),
        (dict(adaptive=_again(), branch_at=(2,), branches=2),
         "a second round of a tree's prompt"),
    ]
    for settings, message in cases:
        with pytest.raises(ValueError, match=message):
            grpo_flow(**{**SETTINGS, **settings})
    with pytest.raises(ValueError, match="RLOO's leave-one-out advantages drop none"):
        rloo_flow(**{**SETTINGS, "adaptive": _again()})


def test_an_asynchronous_run_of_a_flow_with_a_second_round_is_refused_before_it_starts():
    with pytest.raises(Exception, match="samples a group again within a step, which runs "
                       "synchronously only"):
        flowkit.run(grpo_flow(adaptive=_again(), **SETTINGS),
                    RunConfig(steps=1, executors="sim", dashboard=False, asynchronous=True,
                              max_staleness=1))


def test_a_flow_of_trees_with_a_second_round_is_refused_before_it_starts():
    """Built without the recipe (which refuses it when built): a tree's leaves are not its
    roots, so a later round could not number its roots on from them."""
    from dataflows.model_ops import Generate
    from dataflows.rl.front import rl_actor
    from dataflows.rl.ops import grpo_advantages, rollout_metrics
    from dataflows.rl.tasks import sort_prompts
    from flowkit.dsl import Flow, collect, group_by

    actor = rl_actor(None, gpt=None, stages=1)
    with Flow("trees") as flow:
        rollouts = Generate(actor, tags=("rollout",))(
            sort_prompts(count=2), n=1, max_new_tokens=6, branch_at=(2,), branches=2)
        scored = late_sample_reward(rollouts)
        rollout_metrics(collect(scored))
        grpo_advantages(group_by(scored, key="prompt_id", second_round=2),
                        filter_groups=True)
    with pytest.raises(Exception, match="'generate' grows trees, whose leaves are not its "
                       "roots"):
        flowkit.run(flow, RunConfig(steps=1, executors="sim", dashboard=False))
