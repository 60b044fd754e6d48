"""The front every ready-made RL step shares (grpo, ppo, rloo, reinforce_pp): the actor and its
frozen reference, then the step's prompts, n samples each on `rollout` executors with the
actor's weights from the previous step, each sample scored by the reward and by the
reference's log-probabilities, and the step's reward metrics. Each flow goes on from there
with its own advantages and losses."""

from __future__ import annotations

from typing import Any

import attrs

from dataflows.model_ops import Generate, LogProbs
from dataflows.models import flow_model
from dataflows.rl.adaptive import Difficulty, allocate_samples, samples_budget, update_difficulty
from dataflows.rl.config import RLConfig
from dataflows.rl.ops import check_overlong, overlong_penalty, rollout_metrics
from dataflows.rl.trees import SHARED_PREFIX
from flowkit.dsl import Flow, Model, Stream, collect
from flowkit.ops.records import WeightsVersion

__all__ = ["SMALL_GPT", "Sampled", "check_tree", "group_size", "rl_actor", "sample_and_score"]

# the built-in GPT the RL flows default to (byte vocabulary, nothing to download)
SMALL_GPT = {"vocab_size": 256, "n_layer": 4, "n_embd": 128}


def rl_actor(model: Model | None, *, gpt: dict | None, stages: int | None) -> Model:
    """`model` (dataflows/models.py), or the built-in GPT `gpt` named "actor", 2 stages, on
    `train` executors."""
    return flow_model(model, gpt=gpt, default_gpt=SMALL_GPT, name="actor", stages=stages,
                      default_stages=2, tags=("train",))


@attrs.frozen
class Sampled:
    weights: Any  # the actor's weights feedback: bind it to the optimizer step's weights
    rollouts: Any
    scored: Any  # the rollouts, each with its reward
    ref_logprobs: Any


def sample_and_score(flow: Flow, actor: Model, reference: Model | None,
                     config: RLConfig) -> Sampled:
    """Inside `with flow`: `config.prompt_source` makes the step's prompts, `config.sampling`
    says how each is sampled, `config.reward` scores one rollout, and `reference` (if any)
    gives each its reference log-probs. `config.oversample` > 1:
    partial rollouts, that many times the prompts generate, the step takes the first
    `prompts` groups to finish and carries the rest over ([Note: partial rollouts] in
    flowkit/runner/partial.py; an asynchronous run's)."""
    oversample, prompts, sampling = config.oversample, config.prompts, config.sampling
    if not oversample >= 1:
        raise ValueError(f"oversample={oversample!r}: generate at least the step's prompts "
                         "(1: no partial rollouts; 1.5: half as many again)")
    if sampling.take is not None:
        raise ValueError(f"sampling.take={sampling.take!r}: the RL flows take the step's "
                         "prompts from an over-provisioned step; set oversample instead")
    weights = flow.feedback("actor_weights", Stream[WeightsVersion])
    partial = oversample > 1
    count = config.source_prompts
    source, source_config = config.prompt_source, dict(config.source_config or {})
    prompt_items = source(count=count, **source_config)
    if source.reporter is not None:  # the source's own metrics (a dataset's epoch)
        source.reporter(count=count, **source_config)
    adaptive = getattr(config, "adaptive", None)
    if adaptive is not None:  # [Note: adaptive sampling] in dataflows/rl/adaptive.py
        # chained: an asynchronous step allocates by, and folds into, the step just before's
        difficulty = flow.feedback("difficulty", Difficulty, chained=True)
        prompt_items = allocate_samples(
            collect(prompt_items), difficulty,
            budget=samples_budget(adaptive, prompts=prompts, n=sampling.n),
            token_budget=adaptive.token_budget, n_min=adaptive.n_min, n_max=adaptive.n_max,
            allocation=adaptive.allocation, prior=adaptive.prior,
            max_new_tokens=sampling.max_new_tokens)
    # generation runs on `rollout` executors, training on `train` ones: the two overlap
    take = prompts if partial else None
    rollouts = Generate(actor, tags=("rollout",))(
        prompt_items, weights=weights, **attrs.evolve(sampling, take=take).as_config(),
        **config.agent.as_config())
    scored = config.reward(rollouts)
    rollout_metrics(collect(scored))  # the task's own reward, before any shaping
    if adaptive is not None:
        difficulty.bind(update_difficulty(collect(scored), difficulty, ema=adaptive.ema,
                                          pass_reward=adaptive.pass_reward))
    if config.overlong_buffer:
        check_overlong(sampling.max_new_tokens, config.overlong_buffer)  # before anything runs
        scored = overlong_penalty(scored, max_new_tokens=sampling.max_new_tokens,
                                  buffer=config.overlong_buffer,
                                  penalty_factor=config.overlong_penalty_factor)
    ref = None if reference is None else LogProbs(reference, tags=config.reference_tags)(
        rollouts, name="ref_logprobs", temperature=sampling.temperature)
    return Sampled(weights, rollouts, scored, ref)


def check_tree(config: RLConfig) -> None:
    """Tree rollouts' settings, before the flow is built, every error in one line [Note: tree
    rollouts in executors/torch/rollout/branching.py]."""
    errors = config.sampling.branching_errors()
    if config.sampling.branching:
        others = [name for name, on in (
            ("filter_groups", getattr(config, "filter_groups", False)),
            ("an environment", config.agent.environment or config.agent.program)) if on]
        errors += _adaptive_tree_errors(config)
        if config.oversample > 1 and not _carries_trees(config):
            errors.append("partial rollouts (oversample) carry trees over at fixed depths only "
                          "(a continued sample's level is known there), their stale groups "
                          "dropped whole (a stale branch sampled again from its prompt would no "
                          "longer share its parent's prefix): drop branch_entropy and give "
                          "stale_segments='drop', or drop oversample")
        if others:
            errors.append(f"tree rollouts (branch_at, branches) grow every tree of a step "
                          f"whole, of single responses, without {', '.join(others)}: drop "
                          f"{'it' if len(others) == 1 else 'them'} or the branching")
    shared_prefix = getattr(config, "shared_prefix", "per_leaf")
    if shared_prefix not in SHARED_PREFIX:
        errors.append(f"shared_prefix={shared_prefix!r}: one of {', '.join(SHARED_PREFIX)} (a "
                      "token a tree's leaves share trains once in all, or once in each)")
    elif shared_prefix == "once" and config.sampling.branching:
        errors += _tree_loss_errors(config.policy)
    if errors:
        raise ValueError(f"{len(errors)} error(s) in the sampling settings: " + "; ".join(errors))


def _adaptive_tree_errors(config: RLConfig) -> list[str]:
    """Adaptive sampling of trees: its n (n_min, n_max, budget) counts a prompt's roots, each
    growing up to branches^depths leaves [Note: tree rollouts in
    executors/torch/rollout/branching.py]."""
    adaptive = getattr(config, "adaptive", None)
    if adaptive is None:
        return []
    errors = []
    if adaptive.token_budget is not None:
        errors.append("adaptive token_budget costs a prompt's samples at its mean response "
                      "length, and a tree's root generates its shared prefix once and each "
                      "branch's rest: drop token_budget (budget, n_min and n_max count roots)")
    if adaptive.second_round:
        errors.append("a second round of a tree's prompt would number its roots on from its "
                      "first leaves, which a group counts: drop second_round or the branching")
    return errors


def _carries_trees(config: RLConfig) -> bool:
    """Whether partial rollouts may carry its trees over [Note: tree rollouts in
    executors/torch/rollout/branching.py]: at fixed depths (a continued sample's level is
    those at or below its tokens), their stale groups dropped whole (sampled again from the
    prompt, a branch would no longer share its parent's prefix)."""
    return config.sampling.branch_entropy is None and config.sampling.stale_segments == "drop"


def _tree_loss_errors(policy: Any) -> list[str]:
    """A tree's leaves weigh their shared prefix so that it trains once [Note: tree rollouts'
    shared prefix in dataflows/rl/trees.py]: a loss that spreads a response's loss over all its
    tokens cannot be weighed so."""
    if policy.policy_loss == "gspo":
        return ["tree rollouts train a shared prefix once by weighing its tokens, and GSPO's "
                "sequence-level ratio spreads each response's loss over all of its tokens: "
                "use the token-level loss (policy_loss='vanilla'), shared_prefix='per_leaf', "
                "or no branching"]
    if policy.loss_agg_mode == "seq-mean-token-mean":
        return ["tree rollouts train a shared prefix once by weighing its tokens, which "
                "loss_agg_mode='seq-mean-token-mean' would weigh again in each response's "
                "mean: aggregate 'token-mean' or 'seq-mean-token-sum-norm', or "
                "shared_prefix='per_leaf'"]
    return []


def group_size(config: RLConfig) -> int | None:
    """group_by's size for a prompt's samples: the flow's n, or None (a group is what arrived of
    its prompt when the step's samples end) when adaptive sampling gives each prompt its own n
    or tree rollouts grow each sample into leaves (fewer where a sample ends before a branch
    depth) [Note: tree rollouts in executors/torch/rollout/branching.py]."""
    if getattr(config, "adaptive", None) is not None or config.sampling.branching:
        return None
    return config.sampling.n
