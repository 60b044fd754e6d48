"""A GRPO flow whose samples are multi-turn trajectories [Note: multi-turn rollouts in
flowkit/ops/environments.py], end to end on torch executor processes: the guessing game's
environment steps on the rollout executor, its reward scores the trajectories, the actor trains
on the model's tokens only; fused and stage by stage give the same parameters, and the step
reports the trajectories' turns."""

import pytest
import torch

from dataflows.envs import GuessNumber, guess_prompts
from dataflows.grpo import grpo_flow
from dataflows.rewards import environment_reward
from flowkit.planner.lower import lower_flow
from flowkit.runner.flowrun import FlowRunner
from tests.harness import tiny_gpt

TINY = {**tiny_gpt(vocab_size=256, block_size=64), "dtype": "float64", "seed": 3}
GAME = {"low": 1, "high": 4}


def _flow(**settings):
    agent = {"environment": "dataflows.envs:GuessNumber", "env_config": GAME, "max_turns": 3}
    return grpo_flow(prompts=4, n=3, stages=2, microbatches=2, max_new_tokens=3, lr=1e-2,
                     schedule="1f1b", gpt=TINY, prompt_source=guess_prompts, source_config=GAME,
                     reward=environment_reward, **{**agent, **settings})


def _train(pool, tmp_path, *, fuse: bool):
    tags = [("train",), ("train",), ("rollout",)]
    with pool.shared(3, kind="torch", tags=tags) as (ctl, _):
        flow = _flow()
        flow.nodes["update_actor"].config["clip_ratio"] = 10.0  # every token's gradient kept
        runner = FlowRunner(ctl, lower_flow(flow), fuse=fuse)
        reports = [runner.run_step(step) for step in range(2)]
        (path,) = runner.save_weights(tmp_path / ("fused" if fuse else "barrier"))
    return torch.load(path, weights_only=True), reports


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pool):
    tmp = tmp_path_factory.mktemp("agent")
    return {fuse: _train(pool, tmp, fuse=fuse) for fuse in (True, False)}


def test_fused_and_stage_by_stage_train_the_same_parameters(runs):
    fused, barrier = runs[True][0], runs[False][0]
    assert fused.keys() == barrier.keys()
    for name in fused:
        assert torch.allclose(fused[name], barrier[name], atol=1e-10, rtol=0), name


def test_the_steps_report_the_trajectories(runs):
    for report in runs[True][1]:
        metrics = report.metrics
        assert 1 <= metrics["agent/turns_mean"] <= 3 and metrics["agent/turns_max"] <= 3
        assert metrics["agent/env_tokens_mean"] > 0 and metrics["agent/env_error_fraction"] == 0
        assert metrics["agent/env_timeout_fraction"] == 0
        assert metrics["agent/env_seconds_mean"] >= 0
        assert 0 <= metrics["reward_mean"] <= 1


def test_the_game_answers_each_guess():
    env = GuessNumber(low=1, high=8)
    env.reset("guess 1-8:", "5")
    assert (env.step("3").observation, env.step("7\n").observation) == ("higher", "lower")
    assert env.step("no idea").observation == "say a number"
    right = env.step("5")
    assert right.done and right.reward == 1.0
    with pytest.raises(ValueError, match="carry the secret number as their answer"):
        GuessNumber().reset("guess 1-16:", None)


def test_partial_rollouts_carry_trajectories_over_with_their_episodes(pool):
    """Partial rollouts: half as many games again generate, the first groups to finish train,
    the rest carry over to the next step (a trajectory cut mid-way continues with its parked
    episode: [Note: parked trajectories] in executors/torch/rollout/trajectories.py); every step
    trains its groups, none failing its environment."""
    tags = [("train",), ("train",), ("rollout",)]
    with pool.shared(3, kind="torch", tags=tags) as (ctl, _):
        runner = FlowRunner(ctl, lower_flow(_flow(max_staleness=1, oversample=1.5)),
                            staleness=1, steps=4)
        reports = [runner.run_step(step) for step in range(4)]
    for report in reports:
        metrics = report.metrics
        assert metrics["rollout/samples"] >= 12 and metrics["agent/env_error_fraction"] == 0
        assert metrics["staleness/max"] <= 1
    # groups were carried into the step after (here whole: the games end fast; a trajectory
    # cut mid-way continues as tests/torch/test_multiturn.py shows)
    assert sum(r.metrics["rollout/resumed"] for r in reports) > 0


def test_a_prompt_source_of_games_draws_each_steps_secrets():
    first = list(guess_prompts.fn(count=8, step=0, **GAME))
    again = list(guess_prompts.fn(count=8, step=0, **GAME))
    later = list(guess_prompts.fn(count=8, step=1, **GAME))
    assert [p.answer for p in first] == [p.answer for p in again]
    assert {p.prompt_id for p in first}.isdisjoint({p.prompt_id for p in later})
    assert all(1 <= int(p.answer) <= 4 for p in first + later)


def test_an_asynchronous_run_trains_trajectories_sampled_across_weight_updates(pool):
    """Generation one version ahead of training: trajectories keep going while the rollout
    executor loads new weights between their turns and tokens, each token recording the
    version that sampled it; none is older than the bound allows."""
    tags = [("train",), ("train",), ("rollout",)]
    with pool.shared(3, kind="torch", tags=tags) as (ctl, _):
        runner = FlowRunner(ctl, lower_flow(_flow(max_staleness=1)), staleness=1, steps=4)
        reports = [runner.run_step(step) for step in range(4)]
    for step, report in enumerate(reports):
        metrics = report.metrics
        assert metrics["agent/turns_mean"] >= 1 and metrics["agent/env_error_fraction"] == 0
        assert metrics["staleness/max"] <= 1, (step, metrics["staleness/max"])


@pytest.mark.parametrize(("settings", "words"), [
    ({"environment": "dataflows.envs.GuessNumber"}, "is not a class's import name"),
    ({"environment": "dataflows envs:Guess"}, "is not a class's import name"),
    ({"env_config": ["low", 1]}, "is not a dict of keyword arguments"),
    ({"max_turns": 0}, "max_turns"),
])
def test_bad_environment_settings_are_refused_before_anything_runs(settings, words):
    with pytest.raises(Exception, match=words):
        _flow(**settings).validate()
