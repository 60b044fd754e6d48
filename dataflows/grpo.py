"""GRPO: n samples per prompt -> verifiable reward and reference log-probs per sample -> group-
relative advantages as soon as a prompt's n samples are in -> train the actor with a KL term to
the reference, microbatches forming from finished groups -> sync the weights to generation."""

from __future__ import annotations

from dataflows.model_ops import Backprop, OptimizerStep
from dataflows.models import reference_of
from dataflows.rl.adaptive import check_adaptive
from dataflows.rl.config import GroupRLConfig, RLConfig, actor_loss, rl_flow
from dataflows.rl.evaluation import attach_evaluation
from dataflows.rl.front import check_tree, group_size, rl_actor, sample_and_score
from dataflows.rl.ops import grpo_advantages, with_reference
from flowkit.dsl import Flow, Model, collect, group_by

__all__ = ["grpo_flow"]


@rl_flow(GroupRLConfig)
def grpo_flow(config: RLConfig, *, model: Model | None = None, gpt: dict | None = None) -> Flow:
    """`model` is the actor, any Model (dataflows/models.py); without one, the built-in GPT
    configured by `gpt`, in 2 stages. The reference is a frozen copy of the actor, so a
    `checkpoint` in its config starts both from saved weights (e.g. after supervised warm-up).
    `config` (a GroupRLConfig, dataflows/rl/config.py, or its keyword shortcuts: prompts, n,
    max_new_tokens, ...) says the rest; `stages` re-cuts the actor, `max_staleness` runs
    asynchronously ([Note: asynchronous steps] in flowkit/runner/flowrun.py)."""
    _check_filter(config)
    _check_adaptive(config)
    _check_reference(config)
    check_tree(config)
    actor = rl_actor(model, gpt=gpt, stages=config.stages)
    # without a KL term (DAPO, Dr. GRPO, GSPO) nothing reads the reference: none is run
    reference = reference_of(actor) if config.kl_coef else None
    # [Note: reference in the F in executors/torch/train/rows.py]
    in_forward = config.reference_in_forward
    with Flow("grpo", description=__doc__, max_staleness=config.max_staleness) as flow:
        sampled = sample_and_score(flow, actor, None if in_forward else reference, config)
        weights, scored, ref = sampled.weights, sampled.scored, sampled.ref_logprobs
        samples = scored if ref is None else with_reference(scored, ref)
        # No batch statistic: each group trains as soon as its n samples are scored.
        # with filter_groups, the step trains the first `prompts` groups whose rewards differ
        take = config.prompts if config.filter_groups else None
        rounds = config.filter_rounds if take and config.filter_rounds > 1 else None
        # a second round samples again the groups the advantages drop [Note: second rounds]
        again = config.adaptive.group_settings() if config.adaptive else {}
        drop = config.adaptive.group_filter() if config.adaptive else {}
        experiences = grpo_advantages(
            group_by(samples, key="prompt_id", size=group_size(config), take=take,
                     rounds=rounds, **again),
            scale_rewards=config.scale_rewards, shared_prefix=config.shared_prefix,
            **{"filter_groups": config.filter_groups, **drop})
        forward_reference = {"reference": flow.add_model(reference).name} if in_forward else {}
        stats = Backprop(actor)(experiences, loss="grpo", kl_coef=config.kl_coef,
                                temperature=config.sampling.temperature,
                                schedule=config.schedule, microbatches=config.microbatches,
                                name="update_actor", **actor_loss(config), **forward_reference)
        step = OptimizerStep(actor)(collect(stats), lr=config.lr)
        weights.bind(step.weights)
    return attach_evaluation(flow, actor, config)


def _check_reference(config: RLConfig) -> None:
    if not isinstance(config.reference_in_forward, bool):
        raise ValueError(f"reference_in_forward={config.reference_in_forward!r} is not True or "
                         "False")
    if config.reference_in_forward and not config.kl_coef:
        raise ValueError("reference_in_forward=True, but kl_coef=0: without a KL term no "
                         "reference is run; give a kl_coef, or drop reference_in_forward")
    if config.reference_in_forward and config.reference_tags:
        raise ValueError(f"reference_in_forward=True runs the reference on the actor's last "
                         f"stage, so reference_tags={config.reference_tags!r} would place "
                         "nothing: drop one of them")


def _check_filter(config: RLConfig) -> None:
    """Dynamic sampling's settings, before the flow is built."""
    if not getattr(config, "filter_groups", False):
        return
    if config.sampling.n < 2:
        raise ValueError(f"filter_groups drops the groups whose rewards are all equal, and "
                         f"with n={config.sampling.n} sample a prompt every group is: sample "
                         "each prompt at least twice (n=8)")
    if not config.filter_oversample >= 1:
        raise ValueError(f"filter_oversample={config.filter_oversample!r}: generate at least "
                         "the step's prompts (2: twice as many, of which the first `prompts` "
                         "groups whose rewards differ train)")
    if config.oversample > 1:
        raise ValueError("filter_groups and oversample (partial rollouts) both over-provision "
                         "a step's generation; use one of them")
    rounds = config.filter_rounds
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"filter_rounds={rounds!r}: the most rounds of prompts a step "
                         "generates, a whole number >= 1 (1: no second round)")
    if rounds > 1 and config.max_staleness is not None:
        raise ValueError(f"filter_rounds={rounds} generates again within a step, which runs "
                         "synchronously only: drop max_staleness, or set filter_rounds=1")


def _check_adaptive(config: RLConfig) -> None:
    """Adaptive sampling's settings, before the flow is built."""
    adaptive = getattr(config, "adaptive", None)
    if adaptive is None:
        return
    # asynchronous steps keep its books: each step folds into the difficulty of the step
    # just before (a chained feedback, sample_and_score); partial rollouts count each call's
    # own samples (flowkit/runner/partial.py)
    if config.filter_groups:
        raise ValueError("adaptive sampling allocates a step's samples before they are drawn, "
                         "and filter_groups draws rounds until enough groups differ: drop "
                         "filter_groups or adaptive")
    check_adaptive(adaptive, prompts=config.prompts, n=config.sampling.n,
                   max_new_tokens=config.sampling.max_new_tokens)
    if adaptive.second_round and config.max_staleness is not None:
        raise ValueError(f"adaptive second_round={adaptive.second_round} samples again within "
                         "a step, which runs synchronously only: drop max_staleness, or set "
                         "second_round=0")
    if adaptive.second_round and config.oversample > 1:
        raise ValueError(f"adaptive second_round={adaptive.second_round} and partial rollouts "
                         f"(oversample={config.oversample}) both decide which generation calls "
                         "run: use one")
