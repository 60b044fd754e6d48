"""Model ops of the ready-made flows: what executors holding a model will run.

These are declarations (typed signatures); the torch and simulator executors implement the
executor ops they name.
"""

from __future__ import annotations

from flowkit.dsl import Batch, ModelOp, Stream
from flowkit.ops import KL_ALIASES, KL_KINDS, LOSS_KNOBS, LOSSES
from flowkit.ops.records import (
    MicrobatchStats,
    Prompt,
    Rollout,
    StepMetrics,
    TokenScores,
    WeightsVersion,
)
from flowkit.planner.schedules import schedule_kinds

__all__ = ["Backprop", "Generate", "LogProbs", "OptimizerStep", "RewardModel", "Values"]


class Generate(ModelOp):
    """Sample n responses per prompt; each finished sample leaves as soon as it is done."""

    executor_op = "generate"
    many_per_call = True
    fan_out = ("n", "prompt_id")  # n rollouts per call, all of the prompt's prompt_id
    inputs = {"prompts": Stream[Prompt], "weights": Stream[WeightsVersion]}
    optional = ("weights",)
    outputs = {"rollouts": Stream[Rollout]}
    config = {"n": 1, "max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0}
    # temperature 0: greedy
    ranges = {"n": (1, None), "max_new_tokens": (1, None), "temperature": (0, None),
              "top_p": (0, 1)}


class LogProbs(ModelOp):
    """Per-token log-probabilities of each response under the model (e.g. a frozen reference)."""

    executor_op = "logprobs"
    inputs = {"rollouts": Stream[Rollout]}
    outputs = {"logprobs": Stream[TokenScores]}
    config = {"temperature": 1.0}  # the sampler's: log_softmax(logits / temperature)
    ranges = {"temperature": (0, None)}


class Values(ModelOp):
    """Per-token value estimates of each response from a critic (the GPT with a value head);
    `weights` orders it after the critic's last update."""

    executor_op = "values"
    inputs = {"rollouts": Stream[Rollout], "weights": Stream[WeightsVersion]}
    optional = ("weights",)
    outputs = {"values": Stream[TokenScores]}


class RewardModel(ModelOp):
    """A sequence-level score of each response from a reward model."""

    executor_op = "reward_model"
    inputs = {"rollouts": Stream[Rollout]}
    outputs = {"scores": Stream[float]}


class Backprop(ModelOp):
    """F, B and W of the model's pipeline stages over microbatches formed from the items, under
    a pipeline schedule; gradients accumulate on the executors until the optimizer step."""

    executor_op = "backprop"
    lowering = "pipeline"
    many_per_call = True
    # token batches (pretraining) or experiences (RL); reference log-probs for a KL loss term
    inputs = {"batch": Stream[object], "ref_logprobs": Stream[TokenScores]}
    optional = ("ref_logprobs",)
    outputs = {"stats": Stream[MicrobatchStats]}
    # loss: one of flowkit.ops.LOSSES, with its knobs
    config = {"loss": "lm", "schedule": "1f1b", "microbatches": 8, "memory_limit": None,
              **LOSS_KNOBS}
    choices = {"loss": tuple(LOSSES), "kl_kind": (*KL_KINDS, *KL_ALIASES),
               "schedule": tuple(schedule_kinds())}
    ranges = {"microbatches": (1, None), "kl_coef": (0, None), "clip_ratio": (0, None),
              "clip_ratio_c": (1, None), "cliprange_value": (0, None), "temperature": (0, None)}


class OptimizerStep(ModelOp):
    """AdamW over every stage, with gradient clipping by the global norm: needs every microbatch's
    gradient, so its input is a barrier."""

    executor_op = "optimizer_step"
    lowering = "step"
    inputs = {"stats": Batch[MicrobatchStats]}
    outputs = {"metrics": Stream[StepMetrics], "weights": Stream[WeightsVersion]}
    config = {"lr": 3e-4, "weight_decay": 0.1, "betas": (0.9, 0.95), "clip_grad_norm": 1.0}
    ranges = {"lr": (0, None), "weight_decay": (0, None), "clip_grad_norm": (0, None)}


