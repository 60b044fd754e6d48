"""PPO: generate -> reward, reference log-probs and values per sample, each as soon as its sample
is done -> GAE over the batch (advantage whitening: a barrier) -> train actor and critic through
pipeline schedules -> sync both models' weights to the executors that generate and score."""

from __future__ import annotations

from typing import Any

from dataflows.model_ops import Backprop, OptimizerStep, Values
from dataflows.models import critic_of, reference_of
from dataflows.rl.front import rl_actor, sample_and_score
from dataflows.rl.steps import (
    answer_reward,
    arithmetic_prompts,
    gae,
    make_experience,
)
from flowkit.dsl import Flow, Model, Operator, Stream, collect
from flowkit.ops.records import WeightsVersion

__all__ = ["ppo_flow"]


def ppo_flow(*, model: Model | None = None, critic: Model | None = None, prompts: int = 64,
             n: int = 1, stages: int | None = None, schedule: str = "zb-h1",
             microbatches: int = 8, kl_coef: float = 0.05, max_new_tokens: int = 8,
             temperature: float = 1.0, lr: float = 3e-4, critic_lr: float = 1e-3,
             gpt: dict | None = None, prompt_source: Operator = arithmetic_prompts,
             reward: Operator = answer_reward,
             source_config: dict[str, Any] | None = None, ppo_epochs: int = 1,
             minibatches: int = 1, max_staleness: int | None = None,
              oversample: float = 1.0, stale_segments: str = "recompute") -> Flow:
    """As `grpo_flow` (dataflows/grpo.py), with a critic: `critic`, or else the actor's build
    with `value_head=True` (the built-in GPT's value head), fresh weights, as many stages.
    `ppo_epochs` and `minibatches`: actor and critic train on each step's batch `ppo_epochs`
    times, shuffled and cut into `minibatches`, one optimizer step each (Backprop's epochs and
    minibatches); `microbatches` is then per minibatch."""
    actor = rl_actor(model, gpt=gpt, stages=stages)
    reference = reference_of(actor)
    critic = critic_of(actor, critic)
    with Flow("ppo", description=__doc__, max_staleness=max_staleness) as flow:
        sampled = sample_and_score(flow, actor, reference, prompts=prompts, n=n,
                                   max_new_tokens=max_new_tokens, temperature=temperature,
                                   prompt_source=prompt_source, reward=reward,
                                   source_config=source_config, oversample=oversample,
                                   stale_segments=stale_segments)
        weights, scored, ref = sampled.weights, sampled.scored, sampled.ref_logprobs
        critic_weights = flow.feedback("critic_weights", Stream[WeightsVersion])
        values = Values(critic, tags=("rollout",))(sampled.rollouts, weights=critic_weights)
        experiences = make_experience(scored, ref, values, kl_coef=kl_coef)
        batch = gae(collect(experiences))  # whitening over the batch: a barrier
        train = dict(schedule=schedule, microbatches=microbatches, epochs=ppo_epochs,
                     minibatches=minibatches)
        actor_stats = Backprop(actor)(batch, loss="ppo", temperature=temperature,
                                      name="update_actor", **train)
        critic_stats = Backprop(critic)(batch, loss="value", name="update_critic", **train)
        actor_step = OptimizerStep(actor)(collect(actor_stats), lr=lr, name="actor_step")
        critic_step = OptimizerStep(critic)(collect(critic_stats), lr=critic_lr,
                                            name="critic_step")
        weights.bind(actor_step.weights)
        critic_weights.bind(critic_step.weights)
    return flow
