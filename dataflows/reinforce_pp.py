"""REINFORCE++: generate -> verifiable reward and reference log-probs per sample -> token rewards
(the KL penalty on every token, the reward on the last) -> discounted returns whitened over the
batch (no critic: the whitening is the baseline, and a barrier) -> train the actor with the
clipped PPO policy loss -> sync the weights to generation."""

from __future__ import annotations

from dataflows.model_ops import Backprop, OptimizerStep
from dataflows.models import reference_of
from dataflows.rl.advantages import (
    kl_token_rewards,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
)
from dataflows.rl.config import ReinforcePPConfig, actor_loss, rl_flow
from dataflows.rl.evaluation import attach_evaluation
from dataflows.rl.front import rl_actor, sample_and_score
from flowkit.dsl import Flow, Model, collect

__all__ = ["reinforce_pp_flow"]


@rl_flow(ReinforcePPConfig)
def reinforce_pp_flow(config: ReinforcePPConfig, *, model: Model | None = None,
                      gpt: dict | None = None) -> Flow:
    """Called as `grpo_flow` (dataflows/grpo.py), with a ReinforcePPConfig. The KL to the
    reference is in the reward (-kl_coef x the k1 estimate on each token, as the REINFORCE++
    paper), not in the loss: the loss is the clipped PPO policy loss ("ppo"). `gamma`
    discounts the returns. `baseline` makes it REINFORCE++-baseline: a sample's summed token
    rewards (undiscounted: `gamma` is not used) minus its prompt's mean, then the batch
    whitening; it needs n >= 2 samples per prompt."""
    n = config.sampling.n
    if config.baseline and n < 2:
        raise ValueError(f"reinforce_pp_flow(baseline=True) needs n >= 2 samples per prompt "
                         f"(got n={n}): the baseline is the mean score of a prompt's samples")
    actor = rl_actor(model, gpt=gpt, stages=config.stages)
    reference = reference_of(actor)
    with Flow("reinforce_pp", description=__doc__, max_staleness=config.max_staleness) as flow:
        sampled = sample_and_score(flow, actor, reference, config)
        weights, scored, ref = sampled.weights, sampled.scored, sampled.ref_logprobs
        token_rewards = collect(kl_token_rewards(scored, ref, kl_coef=config.kl_coef))
        # whitening over the batch: a barrier
        if config.baseline:
            batch = reinforce_pp_baseline_advantages(token_rewards)
        else:
            batch = reinforce_pp_advantages(token_rewards, gamma=config.gamma)
        stats = Backprop(actor)(batch, loss="ppo", temperature=config.sampling.temperature,
                                schedule=config.schedule, microbatches=config.microbatches,
                                name="update_actor", **actor_loss(config))
        step = OptimizerStep(actor)(collect(stats), lr=config.lr)
        weights.bind(step.weights)
    return attach_evaluation(flow, actor, config)
