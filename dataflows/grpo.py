"""GRPO: n samples per prompt -> verifiable reward and reference log-probs per sample -> group-
relative advantages as soon as a prompt's n samples are in -> train the actor with a KL term to
the reference, microbatches forming from finished groups -> sync the weights to generation."""

from __future__ import annotations

from typing import Any

from dataflows.model_ops import Backprop, OptimizerStep
from dataflows.models import reference_of
from dataflows.rl.front import rl_actor, sample_and_score
from dataflows.rl.steps import (
    answer_reward,
    arithmetic_prompts,
    grpo_advantages,
    with_reference,
)
from flowkit.dsl import Flow, Model, Operator, collect, group_by

__all__ = ["grpo_flow"]


def grpo_flow(*, model: Model | None = None, prompts: int = 16, n: int = 8,
              stages: int | None = None, schedule: str = "zb-h1", microbatches: int = 8,
              max_new_tokens: int = 8, temperature: float = 1.0, kl_coef: float = 0.001,
              lr: float = 3e-4, gpt: dict | None = None,
              prompt_source: Operator = arithmetic_prompts, reward: Operator = answer_reward,
              source_config: dict[str, Any] | None = None,
              max_staleness: int | None = None,
              oversample: float = 1.0, stale_segments: str = "recompute") -> Flow:
    """`model` is the actor, any Model (dataflows/models.py); without one, the built-in GPT
    configured by `gpt`, in 2 stages. The reference is a frozen copy of the actor, so a
    `checkpoint` in its config starts both from saved weights (e.g. after supervised warm-up).
    `stages` re-cuts the actor. `prompt_source` makes the step's prompts (`count=prompts`,
    plus `source_config`), `reward` scores one rollout. `max_staleness`: run asynchronously
    by default, generation up to that many weights versions ahead of training
    ([Note: asynchronous steps] in flowkit/runner/flowrun.py)."""
    actor = rl_actor(model, gpt=gpt, stages=stages)
    reference = reference_of(actor)
    with Flow("grpo", description=__doc__, max_staleness=max_staleness) as flow:
        sampled = sample_and_score(flow, actor, reference, prompts=prompts, n=n,
                                   max_new_tokens=max_new_tokens, temperature=temperature,
                                   prompt_source=prompt_source, reward=reward,
                                   source_config=source_config, oversample=oversample,
                                   stale_segments=stale_segments)
        weights, scored, ref = sampled.weights, sampled.scored, sampled.ref_logprobs
        # No batch statistic: each group trains as soon as its n samples are scored.
        experiences = grpo_advantages(group_by(with_reference(scored, ref), key="prompt_id",
                                               size=n))
        stats = Backprop(actor)(experiences, loss="grpo", kl_coef=kl_coef,
                                temperature=temperature, schedule=schedule,
                                microbatches=microbatches, name="update_actor")
        step = OptimizerStep(actor)(collect(stats), lr=lr)
        weights.bind(step.weights)
    return flow
