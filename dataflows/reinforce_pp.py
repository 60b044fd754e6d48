"""REINFORCE++: generate -> verifiable reward and reference log-probs per sample -> token rewards
(the KL penalty on every token, the reward on the last) -> discounted returns whitened over the
batch (no critic: the whitening is the baseline, and a barrier) -> train the actor with the
clipped PPO policy loss -> sync the weights to generation."""

from __future__ import annotations

from typing import Any

from dataflows.model_ops import Backprop, OptimizerStep
from dataflows.models import reference_of
from dataflows.rl.advantages import (
    kl_token_rewards,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
)
from dataflows.rl.front import rl_actor, sample_and_score
from dataflows.rl.steps import answer_reward, arithmetic_prompts
from flowkit.dsl import Flow, Model, Operator, collect

__all__ = ["reinforce_pp_flow"]


def reinforce_pp_flow(*, model: Model | None = None, prompts: int = 64, n: int = 1,
                      stages: int | None = None, schedule: str = "zb-h1", microbatches: int = 8,
                      max_new_tokens: int = 8, temperature: float = 1.0,
                      kl_coef: float = 0.001, gamma: float = 1.0, baseline: bool = False,
                      lr: float = 3e-4, gpt: dict | None = None,
                      prompt_source: Operator = arithmetic_prompts,
                      reward: Operator = answer_reward,
                      source_config: dict[str, Any] | None = None,
                      max_staleness: int | None = None,
              oversample: float = 1.0, stale_segments: str = "recompute") -> Flow:
    """Called as `grpo_flow` (dataflows/grpo.py). The KL to the reference is in the reward
    (-kl_coef x the k1 estimate on each token, as the REINFORCE++ paper), not in the loss: the
    loss is the clipped PPO policy loss ("ppo"). `gamma` discounts the returns. `baseline`
    makes it REINFORCE++-baseline: a sample's summed token rewards (undiscounted: `gamma` is
    not used) minus its prompt's mean, then the batch whitening; it needs n >= 2 samples per
    prompt."""
    if baseline and n < 2:
        raise ValueError(f"reinforce_pp_flow(baseline=True) needs n >= 2 samples per prompt "
                         f"(got n={n}): the baseline is the mean score of a prompt's samples")
    actor = rl_actor(model, gpt=gpt, stages=stages)
    reference = reference_of(actor)
    with Flow("reinforce_pp", description=__doc__, max_staleness=max_staleness) as flow:
        sampled = sample_and_score(flow, actor, reference, prompts=prompts, n=n,
                                   max_new_tokens=max_new_tokens, temperature=temperature,
                                   prompt_source=prompt_source, reward=reward,
                                   source_config=source_config, oversample=oversample,
                                   stale_segments=stale_segments)
        weights, scored, ref = sampled.weights, sampled.scored, sampled.ref_logprobs
        token_rewards = collect(kl_token_rewards(scored, ref, kl_coef=kl_coef))
        # whitening over the batch: a barrier
        if baseline:
            batch = reinforce_pp_baseline_advantages(token_rewards)
        else:
            batch = reinforce_pp_advantages(token_rewards, gamma=gamma)
        stats = Backprop(actor)(batch, loss="ppo", temperature=temperature, schedule=schedule,
                                microbatches=microbatches, name="update_actor")
        step = OptimizerStep(actor)(collect(stats), lr=lr)
        weights.bind(step.weights)
    return flow
