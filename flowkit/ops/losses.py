"""The losses a Backprop trains with, and their knobs: what the runtime puts in each pipeline
op's config and the executors implement (executors/torch/train/rl_loss.py; the simulator only
reports a loss)."""

from __future__ import annotations

from flowkit.dsl import LossSpec
from flowkit.ops.configs import SAMPLING

__all__ = ["KL_ALIASES", "KL_KINDS", "LOSSES", "LOSS_AGG_MODES", "LOSS_KNOBS", "LOSS_SPEC",
           "POLICY_LOSSES", "PROXIMAL_LOSSES", "ROLLOUT_IS_LEVELS", "ROLLOUT_IS_MODES",
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
flowkit/runner/model_training.py]."""

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                  "seq-mean-token-sum-norm")
"""verl's loss_agg_mode: how a step's per-token losses become one number. token-mean: every
trained token weighs the same (DAPO's token-level loss); seq-mean-token-mean: every response
the same, its tokens averaged (GRPO's paper); seq-mean-token-sum: every response the same,
its tokens summed; seq-mean-token-sum-norm: summed over a constant, `loss_scale_factor`
(Dr. GRPO's unbiased loss). Every term of the loss (policy, KL, entropy) is aggregated alike."""

POLICY_LOSSES = ("vanilla", "gspo")
"""verl's policy_loss.loss_mode: the dual-clip PPO objective per token, or GSPO's (Zheng et
al. 2025) sequence-level ratio, clipped per response."""

ROLLOUT_IS_LEVELS = ("token", "sequence", "geometric")
ROLLOUT_IS_MODES = ("truncate", "mask")

LOSS_KNOBS = {"kl_coef": 0.0, "kl_kind": "k3", "clip_ratio": 0.2, "clip_ratio_c": 3.0,
              "clip_ratio_low": None, "clip_ratio_high": None, "loss_agg_mode": None,
              "loss_scale_factor": None, "policy_loss": "vanilla", "entropy_coeff": 0.0,
              "mask_truncated": False, "cliprange_value": 0.2,
              "temperature": SAMPLING.temperature, "decoupled": False, "behav_cap": 5.0,
              "rollout_is": None, "rollout_is_mode": "truncate", "rollout_is_threshold": 2.0,
              "rollout_is_threshold_lower": None, "rollout_is_veto_threshold": 1e-4}
"""Each knob of the RL losses with its default (verl's); `temperature` is the sampler's, so the
ratio starts at 1 only when log-probs are taken as generation took them.

`clip_ratio_low`, `clip_ratio_high`: the ratio is clipped to [1 - low, 1 + high], each
`clip_ratio` where None (DAPO's clip-higher: high 0.28). `loss_agg_mode`: one of
LOSS_AGG_MODES; None is the policy loss's own (token-mean; GSPO: seq-mean-token-mean).
`loss_scale_factor`: seq-mean-token-sum-norm's constant (the RL flows give the generation
budget, max_new_tokens). `policy_loss`: one of POLICY_LOSSES. `entropy_coeff`: an entropy
bonus, the loss minus entropy_coeff x the aggregated token entropy (the entropy is reported
either way). `mask_truncated`: train nothing on responses cut at the budget (finished False),
TRL's mask_truncated_completions.

`rollout_is` (None, or a level of ROLLOUT_IS_LEVELS): correct for the sampler's log-probs
differing from the trainer's (verl's rollout correction, TIS / MIS): the ratio is taken
against the trainer's own log-probs and each token's loss weighed by trainer / sampler
probability at that level, truncated at `rollout_is_threshold` or, with `rollout_is_mode`
"mask", zeroed outside [rollout_is_threshold_lower (1 / threshold when None), threshold]; a
response with a token ratio below `rollout_is_veto_threshold` (None: no veto) is dropped. Both
take the trainer's log-probs from the very forward pass (detached), so they need one optimizer
step per sample (epochs = minibatches = 1).

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
