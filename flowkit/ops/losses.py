"""The losses a Backprop trains with, and their knobs: what the runtime puts in each pipeline
op's config and the executors implement (executors/torch/rl_loss.py; the simulator only
reports a loss)."""

from __future__ import annotations

from flowkit.dsl import LossSpec
from flowkit.ops.configs import SAMPLING

__all__ = ["KL_ALIASES", "KL_KINDS", "LOSSES", "LOSS_KNOBS", "LOSS_SPEC", "PROXIMAL_LOSSES",
           "SUM_FORM_LOSSES"]

LOSSES = {
    "lm": "next-token cross-entropy, a mean per token",
    "grpo": "the clipped policy loss plus kl_coef x the kl_kind estimate of the KL to the "
            "reference",
    "ppo": "the clipped (dual-clip) policy loss",
    "value": "the clipped value loss of a critic",
}

SUM_FORM_LOSSES = ("grpo", "ppo", "value")
"""Losses whose microbatches return sums that the optimizer step divides by the step's total
(the `normalizer` of their stats), so a microbatch's loss needs no batch total: a backprop with
one of them can start before its last item exists [Note: streamed microbatches in
flowkit/runner/flowtrain.py]."""

LOSS_KNOBS = {"kl_coef": 0.0, "kl_kind": "k3", "clip_ratio": 0.2, "clip_ratio_c": 3.0,
              "cliprange_value": 0.2, "temperature": SAMPLING.temperature, "decoupled": False,
              "behav_cap": 5.0}
"""Each knob of the RL losses with its default (verl's); `temperature` is the sampler's, so the
ratio starts at 1 only when log-probs are taken as generation took them.

`decoupled`: the policy loss is AReaL's decoupled PPO objective (Fu et al. 2025) for samples of
older weights: the clipped ratio is taken against the weights being trained (the proximal
policy, whose log-probs are the very forward pass's, detached) and each token is weighted by
proximal / behaviour probability, the behaviour log-probs being `Experience.logprobs`, what the
sampler recorded. Off, the ratio is against `Experience.logprobs`, as in synchronous PPO.
`behav_cap`: that weight's upper bound (> 0; >= 1 in a flow). A larger weight is clamped to it
(truncated importance sampling), where AReaL masks such tokens out."""

PROXIMAL_LOSSES = ("grpo", "ppo")
"""The policy losses, which take the `decoupled` objective for stale samples in an asynchronous
run ([Note: asynchronous steps] in flowkit/runner/flowrun.py)."""

KL_KINDS = ("k1", "abs", "k2", "k3")
"""The estimators of the KL to the reference that `kl_kind` names (k3: Schulman's low-variance
estimator)."""

KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
"""verl's older names for the same estimators, so configs written for verl work unchanged."""

LOSS_SPEC = LossSpec(key="loss", names=LOSSES, knobs=LOSS_KNOBS, sum_form=SUM_FORM_LOSSES,
                     proximal=PROXIMAL_LOSSES, proximal_knob="decoupled")
"""What the runner needs to know of these losses (a Backprop's `loss_spec`), so it names none."""
