"""PPO: generate -> reward, reference log-probs and values per sample, each as soon as its sample
is done -> GAE over the batch (advantage whitening: a barrier) -> train actor and critic through
pipeline schedules -> sync both models' weights to the executors that generate and score."""

from __future__ import annotations

from dataflows.model_ops import Backprop, OptimizerStep, Values
from dataflows.models import critic_of, reference_of
from dataflows.rl.config import PPOConfig, actor_loss, rl_flow
from dataflows.rl.evaluation import attach_evaluation
from dataflows.rl.front import rl_actor, sample_and_score
from dataflows.rl.ops import gae, make_experience
from flowkit.dsl import Flow, Model, Stream, collect
from flowkit.ops.records import WeightsVersion

__all__ = ["ppo_flow"]


@rl_flow(PPOConfig)
def ppo_flow(config: PPOConfig, *, model: Model | None = None, critic: Model | None = None,
             gpt: dict | None = None) -> Flow:
    """As `grpo_flow` (dataflows/grpo.py), with a PPOConfig and a critic: `critic`, or else the
    actor's build with `value_head=True` (the built-in GPT's value head), fresh weights, as
    many stages. With `ppo_epochs` and `minibatches`, `microbatches` is per minibatch."""
    actor = rl_actor(model, gpt=gpt, stages=config.stages)
    reference = reference_of(actor)
    critic = critic_of(actor, critic)
    with Flow("ppo", description=__doc__, max_staleness=config.max_staleness) as flow:
        sampled = sample_and_score(flow, actor, reference, config)
        weights, scored, ref = sampled.weights, sampled.scored, sampled.ref_logprobs
        critic_weights = flow.feedback("critic_weights", Stream[WeightsVersion])
        values = Values(critic, tags=("rollout",))(sampled.rollouts, weights=critic_weights)
        experiences = make_experience(scored, ref, values, kl_coef=config.kl_coef)
        batch = gae(collect(experiences))  # whitening over the batch: a barrier
        train = dict(schedule=config.schedule, microbatches=config.microbatches,
                     epochs=config.ppo_epochs, minibatches=config.minibatches,
                     fuse="actor+critic" if config.fuse_models else None)
        actor_stats = Backprop(actor)(batch, loss="ppo", temperature=config.sampling.temperature,
                                      name="update_actor", **train, **actor_loss(config))
        critic_stats = Backprop(critic)(batch, loss="value", name="update_critic", **train)
        actor_step = OptimizerStep(actor)(collect(actor_stats), lr=config.lr, name="actor_step")
        critic_step = OptimizerStep(critic)(collect(critic_stats), lr=config.critic_lr,
                                            name="critic_step")
        weights.bind(actor_step.weights)
        critic_weights.bind(critic_step.weights)
    return attach_evaluation(flow, actor, config)
