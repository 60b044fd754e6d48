"""GRPO: n samples per prompt -> verifiable reward and reference log-probs per sample -> group-
relative advantages as soon as a prompt's n samples are in -> train the actor with a KL term to
the reference, microbatches forming from finished groups -> sync the weights to generation."""

from __future__ import annotations

from typing import Any

from dataflows.models import flow_model, reference_of
from dataflows.ops import Backprop, Generate, LogProbs, OptimizerStep
from dataflows.rl.steps import (
    answer_reward,
    arithmetic_prompts,
    grpo_advantages,
    rollout_metrics,
    with_reference,
)
from flowkit.dsl import Flow, Model, Operator, Stream, collect, group_by
from flowkit.ops.records import WeightsVersion

__all__ = ["grpo_flow"]

_SMALL_GPT = {"vocab_size": 256, "n_layer": 4, "n_embd": 128}


def grpo_flow(*, model: Model | None = None, prompts: int = 16, n: int = 8,
              stages: int | None = None, schedule: str = "zb-h1", microbatches: int = 8,
              max_new_tokens: int = 8, temperature: float = 1.0, kl_coef: float = 0.001,
              lr: float = 3e-4, gpt: dict | None = None,
              prompt_source: Operator = arithmetic_prompts, reward: Operator = answer_reward,
              source_config: dict[str, Any] | None = None) -> Flow:
    """`model` is the actor, any Model (dataflows/models.py); without one, the built-in GPT
    configured by `gpt`, in 2 stages. The reference is a frozen copy of the actor, so a
    `checkpoint` in its config starts both from saved weights (e.g. after supervised warm-up).
    `stages` re-cuts the actor. `prompt_source` makes the step's prompts (`count=prompts`,
    plus `source_config`), `reward` scores one rollout."""
    actor = flow_model(model, gpt=gpt, default_gpt=_SMALL_GPT, name="actor", stages=stages,
                       default_stages=2, tags=("train",))
    reference = reference_of(actor)
    with Flow("grpo", description=__doc__) as flow:
        weights = flow.feedback("actor_weights", Stream[WeightsVersion])
        prompt_items = prompt_source(count=prompts, **(source_config or {}))
        # generation runs on `rollout` executors, training on `train` ones: the two overlap
        rollouts = Generate(actor, tags=("rollout",))(prompt_items, weights=weights, n=n,
                                   max_new_tokens=max_new_tokens, temperature=temperature)
        scored = reward(rollouts)
        rollout_metrics(collect(scored))
        ref = LogProbs(reference)(rollouts, name="ref_logprobs", temperature=temperature)
        # No batch statistic: each group trains as soon as its n samples are scored.
        experiences = grpo_advantages(group_by(with_reference(scored, ref), key="prompt_id",
                                               size=n))
        stats = Backprop(actor)(experiences, loss="grpo", kl_coef=kl_coef,
                                temperature=temperature, schedule=schedule,
                                microbatches=microbatches, name="update_actor")
        step = OptimizerStep(actor)(collect(stats), lr=lr)
        weights.bind(step.weights)
    return flow
