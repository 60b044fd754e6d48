"""PPO: generate -> reward, reference log-probs, values per sample -> GAE over the batch -> train
actor and critic through pipeline schedules -> sync the actor's weights to generation."""

from __future__ import annotations

from dataflows.ops import Backprop, Generate, LogProbs, OptimizerStep, Values
from dataflows.records import WeightsVersion
from dataflows.rl.steps import answer_reward, arithmetic_prompts, gae, make_experience
from flowkit.dsl import Flow, Model, Stream, collect

__all__ = ["ppo_flow"]

_GPT = "executors.torch.models.gpt:GPT"


def ppo_flow(*, prompts: int = 64, stages: int = 2, schedule: str = "zb-h1",
             microbatches: int = 8, kl_coef: float = 0.05, max_new_tokens: int = 8) -> Flow:
    gpt = {"vocab_size": 256, "n_layer": 4, "n_embd": 128}
    actor = Model(name="actor", build=_GPT, stages=stages, tags=("train",), config=gpt)
    reference = Model(name="reference", build=_GPT, tags=("rollout",), config=gpt)
    critic = Model(name="critic", build=_GPT, stages=stages, tags=("train",),
                   config={**gpt, "value_head": True})
    with Flow("ppo", description=__doc__) as flow:
        weights = flow.feedback("actor_weights", Stream[WeightsVersion])
        rollouts = Generate(actor)(arithmetic_prompts(count=prompts), weights=weights,
                                   max_new_tokens=max_new_tokens)
        scored = answer_reward(rollouts)
        ref = LogProbs(reference)(rollouts, name="ref_logprobs")
        values = Values(critic)(rollouts)
        experiences = make_experience(scored, ref, values, kl_coef=kl_coef)
        batch = gae(collect(experiences))  # whitening over the batch: a barrier
        train = dict(schedule=schedule, microbatches=microbatches)
        actor_stats = Backprop(actor)(batch, loss="ppo-policy", name="train_actor", **train)
        critic_stats = Backprop(critic)(batch, loss="value", name="train_critic", **train)
        actor_step = OptimizerStep(actor)(collect(actor_stats), name="actor_step")
        OptimizerStep(critic)(collect(critic_stats), name="critic_step")
        weights.bind(actor_step.weights)
    return flow
