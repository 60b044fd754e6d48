"""RLOO: n samples per prompt -> verifiable reward and reference log-probs per sample -> the KL
penalty folded into each sample's token rewards -> leave-one-out advantages as soon as a
prompt's n samples are in -> train the actor with the clipped PPO policy loss, microbatches
forming from finished groups -> sync the weights to generation."""

from __future__ import annotations

from typing import Any

from dataflows.model_ops import Backprop, OptimizerStep
from dataflows.models import reference_of
from dataflows.rl.advantages import kl_token_rewards, rloo_advantages
from dataflows.rl.front import rl_actor, sample_and_score
from dataflows.rl.steps import answer_reward, arithmetic_prompts
from flowkit.dsl import Flow, Model, Operator, collect, group_by

__all__ = ["rloo_flow"]


def rloo_flow(*, model: Model | None = None, prompts: int = 16, n: int = 8,
              stages: int | None = None, schedule: str = "zb-h1", microbatches: int = 8,
              max_new_tokens: int = 8, temperature: float = 1.0, kl_coef: float = 0.001,
              lr: float = 3e-4, gpt: dict | None = None,
              prompt_source: Operator = arithmetic_prompts, reward: Operator = answer_reward,
              source_config: dict[str, Any] | None = None,
              max_staleness: int | None = None,
              oversample: float = 1.0, stale_segments: str = "recompute") -> Flow:
    """Called as `grpo_flow` (dataflows/grpo.py). A sample's score is its reward minus kl_coef x
    its summed k1 KL to the reference (the KL in the reward, as the RLOO paper and verl's
    `use_kl_in_reward`); its advantage, that score minus the mean of the other n-1 samples of
    its prompt. The loss is the clipped PPO policy loss ("ppo"), with no KL term of its own."""
    if n < 2:
        raise ValueError(f"rloo_flow needs n >= 2 samples per prompt (got n={n}): a sample's "
                         "baseline is the mean reward of the others to its prompt")
    actor = rl_actor(model, gpt=gpt, stages=stages)
    reference = reference_of(actor)
    with Flow("rloo", description=__doc__, max_staleness=max_staleness) as flow:
        sampled = sample_and_score(flow, actor, reference, prompts=prompts, n=n,
                                   max_new_tokens=max_new_tokens, temperature=temperature,
                                   prompt_source=prompt_source, reward=reward,
                                   source_config=source_config, oversample=oversample,
                                   stale_segments=stale_segments)
        weights, scored, ref = sampled.weights, sampled.scored, sampled.ref_logprobs
        token_rewards = kl_token_rewards(scored, ref, kl_coef=kl_coef)
        # No batch statistic: each group trains as soon as its n samples are scored.
        experiences = rloo_advantages(group_by(token_rewards, key="prompt_id", size=n))
        stats = Backprop(actor)(experiences, loss="ppo", temperature=temperature,
                                schedule=schedule, microbatches=microbatches,
                                name="update_actor")
        step = OptimizerStep(actor)(collect(stats), lr=lr)
        weights.bind(step.weights)
    return flow
