"""GRPO: n samples per prompt -> verifiable reward per sample -> group-relative advantages as soon
as a prompt's n samples are in -> train the actor with a KL term to the reference -> sync weights."""

from __future__ import annotations

from dataflows.ops import Backprop, Generate, LogProbs, OptimizerStep
from dataflows.records import WeightsVersion
from dataflows.rl.steps import answer_reward, arithmetic_prompts, grpo_advantages
from flowkit.dsl import Flow, Model, Stream, collect, group_by

__all__ = ["grpo_flow"]

_GPT = "executors.torch.models.gpt:GPT"


def grpo_flow(*, prompts: int = 16, n: int = 8, stages: int = 2, schedule: str = "zb-h1",
              microbatches: int = 8, max_new_tokens: int = 8, kl_coef: float = 0.001) -> Flow:
    gpt = {"vocab_size": 256, "n_layer": 4, "n_embd": 128}
    actor = Model(name="actor", build=_GPT, stages=stages, tags=("train",), config=gpt)
    reference = Model(name="reference", build=_GPT, tags=("rollout",), config=gpt)
    with Flow("grpo", description=__doc__) as flow:
        weights = flow.feedback("actor_weights", Stream[WeightsVersion])
        rollouts = Generate(actor)(arithmetic_prompts(count=prompts), weights=weights, n=n,
                                   max_new_tokens=max_new_tokens)
        scored = answer_reward(rollouts)
        # No batch statistic: each group trains as soon as its n samples are scored.
        experiences = grpo_advantages(group_by(scored, key="prompt_id", size=n))
        ref = LogProbs(reference)(rollouts, name="ref_logprobs")
        stats = Backprop(actor)(experiences, ref_logprobs=ref, loss="grpo", kl_coef=kl_coef,
                                schedule=schedule, microbatches=microbatches)
        step = OptimizerStep(actor)(collect(stats))
        weights.bind(step.weights)
    return flow
