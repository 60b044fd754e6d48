"""RLOO: n samples per prompt -> verifiable reward and reference log-probs per sample -> the KL
penalty folded into each sample's token rewards -> leave-one-out advantages as soon as a
prompt's n samples are in -> train the actor with the clipped PPO policy loss, microbatches
forming from finished groups -> sync the weights to generation."""

from __future__ import annotations

from dataflows.model_ops import Backprop, OptimizerStep
from dataflows.models import reference_of
from dataflows.rl.adaptive import check_adaptive
from dataflows.rl.advantages import kl_token_rewards, rloo_advantages
from dataflows.rl.config import GroupRLConfig, RLConfig, actor_loss, rl_flow
from dataflows.rl.evaluation import attach_evaluation
from dataflows.rl.front import check_tree, group_size, rl_actor, sample_and_score
from flowkit.dsl import Flow, Model, collect, group_by

__all__ = ["rloo_flow"]


@rl_flow(GroupRLConfig)
def rloo_flow(config: RLConfig, *, model: Model | None = None, gpt: dict | None = None) -> Flow:
    """Called as `grpo_flow` (dataflows/grpo.py). A sample's score is its reward minus kl_coef x
    its summed k1 KL to the reference (the KL in the reward, as the RLOO paper and verl's
    `use_kl_in_reward`); its advantage, that score minus the mean of the other n-1 samples of
    its prompt. The loss is the clipped PPO policy loss ("ppo"), with no KL term of its own."""
    n = config.sampling.n
    check_tree(config)
    if config.adaptive is not None:
        siblings = None if config.sampling.branching else "rloo_flow's leave-one-out baseline"
        check_adaptive(config.adaptive, prompts=config.prompts, n=n,
                       max_new_tokens=config.sampling.max_new_tokens,
                       needs_siblings=siblings)  # a tree's leaves are siblings
        if config.adaptive.second_round:
            raise ValueError(f"adaptive second_round={config.adaptive.second_round} samples "
                             "again the groups whose rewards agree, which GRPO's advantages "
                             "drop; RLOO's leave-one-out advantages drop none: use grpo_flow, "
                             "or set second_round=0")
    elif n < 2 and not config.sampling.branching:  # a tree's leaves are siblings
        raise ValueError(f"rloo_flow needs n >= 2 samples per prompt (got n={n}): a sample's "
                         "baseline is the mean reward of the others to its prompt")
    grpo_only = [name for name, on in (("filter_groups", config.filter_groups),
                                       ("scale_rewards=False", not config.scale_rewards)) if on]
    if grpo_only:
        raise ValueError(f"{', '.join(grpo_only)}: GRPO's settings (its advantages), which "
                         "rloo_flow's leave-one-out advantages do not take; use grpo_flow")
    if config.reference_in_forward:
        raise ValueError("reference_in_forward=True: rloo_flow folds the KL into each sample's "
                         "rewards before its advantages, so the reference scores every "
                         "rollout first; only grpo_flow (the KL in its loss) takes it in the "
                         "forward")
    actor = rl_actor(model, gpt=gpt, stages=config.stages)
    reference = reference_of(actor)
    with Flow("rloo", description=__doc__, max_staleness=config.max_staleness) as flow:
        sampled = sample_and_score(flow, actor, reference, config)
        weights, scored, ref = sampled.weights, sampled.scored, sampled.ref_logprobs
        token_rewards = kl_token_rewards(scored, ref, kl_coef=config.kl_coef)
        # No batch statistic: each group trains as soon as its n samples are scored.
        experiences = rloo_advantages(group_by(token_rewards, key="prompt_id",
                                               size=group_size(config)),
                                      shared_prefix=config.shared_prefix)
        stats = Backprop(actor)(experiences, loss="ppo", temperature=config.sampling.temperature,
                                schedule=config.schedule, microbatches=config.microbatches,
                                name="update_actor", **actor_loss(config))
        step = OptimizerStep(actor)(collect(stats), lr=config.lr)
        weights.bind(step.weights)
    return attach_evaluation(flow, actor, config)
