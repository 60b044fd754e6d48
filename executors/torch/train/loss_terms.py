"""The per-token RL loss terms the torch executor trains with (rl_loss.py), on padded
(batch, response_length) tensors: PPO's and GSPO's clipped token losses and their statistics, the
clipped value loss, loss aggregation in sum form, rollout importance weights, the decoupled
objective's weights, entropy and KL penalties.

The math and edge cases follow verl's `verl/trainer/ppo/core_algos.py` so that a run here can be
compared number for number with a verl run: the same dual-clip PPO loss and the same loss
aggregation modes. The advantage estimators and whole losses, a tensor reference the tests check
the flows and this module against, are tests/rl/reference_algos.py. Every tensor argument is
(B, T); `mask` is a float mask, 1 on real response tokens and 0 on padding (left or right).
"""

from __future__ import annotations

import math

import torch

from flowkit.ops import (
    KL_ALIASES,
    LOSS_AGG_MODES,
    LOSS_KNOBS,
    ROLLOUT_IS_LEVELS,
    ROLLOUT_IS_MODES,
)

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_IS_MODES",
    "aggregate_sum",
    "behav_weights",
    "decoupled_weight_stats",
    "entropy_from_logprobs",
    "gspo_token_losses",
    "kl_penalty",
    "mismatch_metrics",
    "ppo_token_losses_and_stats",
    "rollout_is_weights",
    "value_token_losses",
]

# verl clamps log-ratios to +-20 before exp() so that one stale token cannot overflow the loss.
_LOG_RATIO_CLAMP = 20.0
# ... and clamps the k3 estimate to +-10 for the same reason.
_K3_CLAMP = 10.0


# ----------------------------------------------------------------------------- validation


def _check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise one ValueError listing every argument that is not 2-D or not shaped like the first."""
    names = list(tensors)
    expected = tuple(tensors[names[0]].shape)
    problems = []
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            problems.append(f"{name} is a {type(tensor).__name__}, expected a torch.Tensor")
        elif tensor.dim() != 2:
            problems.append(f"{name} has shape {tuple(tensor.shape)}, expected 2-D "
                            f"(batch, response_length)")
        elif 0 in tuple(tensor.shape):
            problems.append(f"{name} has shape {tuple(tensor.shape)}, expected at least one row "
                            f"and one position")
        elif tuple(tensor.shape) != expected:
            problems.append(f"{name} has shape {tuple(tensor.shape)}, expected {expected} "
                            f"like {names[0]}")
    if problems:
        raise ValueError(f"{len(problems)} shape error(s): " + "; ".join(problems))


def _require_tokens(mask: torch.Tensor, what: str, at_least: int = 1) -> None:
    """Reductions over the mask are 0/0 without real tokens; say so instead of returning NaN."""
    count = int(mask.sum().item())
    if count < at_least:
        raise ValueError(f"{what} needs at least {at_least} masked-in token(s), "
                         f"but the mask has {count}")


# ----------------------------------------------------------------------------- masked statistics


def _masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of values * mask; padding is zeroed first, so NaN or inf there (say a log-prob of a
    pad token) cannot leak in through 0 * NaN, as in current verl."""
    masked = torch.where(mask.bool(), values, torch.zeros_like(values)) * mask
    return masked.sum() if dim is None else masked.sum(dim=dim)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the entries where mask is 1 (a scalar)."""
    return _masked_sum(values, mask) / mask.sum()


# ----------------------------------------------------------------------------- loss aggregation


def _nonempty_rows(mask: torch.Tensor) -> torch.Tensor:
    return (mask.sum(dim=-1) > 0).to(mask.dtype).sum()


AGG_MODES = LOSS_AGG_MODES
"""verl's loss_agg_mode values. seq-mean-token-sum-norm is Dr. GRPO's (Liu et al. 2025): each
response's summed token losses over a constant (`scale_factor`, the generation budget) rather
than its own length, then the mean over responses, as the paper and TRL's loss_type="dr_grpo"
write it. verl's agg_loss leaves out that mean (its sum over responses / the constant grows
with the batch; its trainer divides by the gradient accumulation steps instead): on one batch,
verl's value is this one times the responses with tokens."""


def aggregate_sum(losses: torch.Tensor, mask: torch.Tensor, agg: str,
                  scale_factor: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(total, normalizer) with total / normalizer == the `agg` aggregate, where the
    normalizer is what the mode divides by over a whole batch (tokens, or responses with
    tokens): summed over any cut of the batch, the totals over the normalizers are the whole
    batch's aggregate [Note: RL losses in sum form in executors/torch/train/rl_loss.py]."""
    _check_agg(agg)
    if agg == "token-mean":
        return _masked_sum(losses, mask), mask.sum()
    counts = mask.sum(dim=-1)
    rows = _masked_sum(losses, mask, dim=-1)  # (B,)
    if agg == "seq-mean-token-mean":
        # verl's +1e-8 keeps fully padded rows finite (they add 0) and is kept so that the
        # two agree to the last digits
        rows = rows / (counts + 1e-8)
    elif agg == "seq-mean-token-sum-norm":
        rows = rows / _scale_factor(scale_factor, mask)
    return (rows * (counts > 0).to(rows.dtype)).sum(), _nonempty_rows(mask)


def _scale_factor(scale_factor: float | None, mask: torch.Tensor) -> float:
    """Dr. GRPO's constant: given, else verl's default, the padded response width."""
    if scale_factor is None:
        return float(mask.shape[-1])
    if not scale_factor > 0:
        raise ValueError(f"loss_scale_factor is {scale_factor}, expected > 0: the constant "
                         f"that seq-mean-token-sum-norm divides each response's sum by (the "
                         f"generation budget, max_new_tokens)")
    return float(scale_factor)


def _check_agg(agg: str) -> None:
    if agg not in AGG_MODES:
        raise ValueError(f"unknown agg {agg!r}; expected one of {', '.join(AGG_MODES)}")


# ----------------------------------------------------------------------------- PPO losses


def _clip_range(clip_ratio: float, low: float | None, high: float | None) -> tuple[float, float]:
    """(low, high): each side's bound, `clip_ratio` where not given (DAPO's clip-higher sets
    `high` above it, verl's clip_ratio_low / clip_ratio_high)."""
    low = clip_ratio if low is None else low
    high = clip_ratio if high is None else high
    if not (low >= 0 and high >= 0):
        raise ValueError(f"clip ranges are ({low}, {high}), expected both >= 0: the ratio is "
                         f"clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]")
    return float(low), float(high)


def _ppo_token_terms(old_logprob: torch.Tensor, logprob: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor, clip_ratio: float, clip_ratio_c: float,
                     clip_ratio_low: float | None = None, clip_ratio_high: float | None = None
                     ) -> dict[str, torch.Tensor]:
    """Per-token pieces of the dual-clip PPO objective, shared by the loss and its statistics."""
    _check_same_shape(old_logprob=old_logprob, logprob=logprob, advantages=advantages, mask=mask)
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c is {clip_ratio_c}, expected > 1: it bounds the ratio "
                         f"from above for negative advantages (dual-clip PPO)")
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = torch.clamp(logprob - old_logprob, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    pessimistic = torch.maximum(unclipped, clipped)
    # Dual clip: for A < 0 a huge ratio would make the loss unbounded; cap it at -A * c.
    dual_cap = -advantages * clip_ratio_c
    losses = torch.where(advantages < 0, torch.minimum(dual_cap, pessimistic), pessimistic)
    return {"losses": losses, "log_ratio": log_ratio, "unclipped": unclipped,
            "clipped": clipped, "pessimistic": pessimistic, "dual_cap": dual_cap}


def ppo_token_losses_and_stats(old_logprob: torch.Tensor, logprob: torch.Tensor,
                               advantages: torch.Tensor, mask: torch.Tensor,
                               clip_ratio: float = 0.2, clip_ratio_c: float = 3.0, *,
                               clip_ratio_low: float | None = None,
                               clip_ratio_high: float | None = None
                               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ppo_token_losses and ppo_policy_loss_stats from one computation of the terms (a loss
    that reports its statistics every microbatch)."""
    terms = _ppo_token_terms(old_logprob, logprob, advantages, mask, clip_ratio, clip_ratio_c,
                             clip_ratio_low, clip_ratio_high)
    with torch.no_grad():
        stats = _ppo_stats(terms, advantages, mask)
    return terms["losses"], stats


def _ppo_stats(terms: dict[str, torch.Tensor], advantages: torch.Tensor,
               mask: torch.Tensor) -> dict[str, torch.Tensor]:
    _require_tokens(mask, "PPO statistics")
    dual_bound = (terms["pessimistic"] > terms["dual_cap"]) & (advantages < 0)
    return {
        "clipfrac": _masked_mean((terms["clipped"] > terms["unclipped"]).to(mask.dtype), mask),
        "clipfrac_lower": _masked_mean(dual_bound.to(mask.dtype), mask),
        "approx_kl": _masked_mean(-terms["log_ratio"], mask),
    }


# ----------------------------------------------------------------------------- GSPO
# Group Sequence Policy Optimization (Zheng et al. 2025): one importance ratio per response, the
# geometric mean of its token ratios, clipped per response. As verl writes it, each token
# carries the response's ratio as its value and its own log-prob's gradient,
#     s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)],  log s_i = mean_t (log pi - log pi_old),
# so the gradient of the mean over the response's tokens is s_i times the mean of the tokens'
# score gradients: the sequence-level objective.

_GSPO_LOG_RATIO_MAX = 10.0  # verl clamps the log ratio from above only


def gspo_token_losses(old_logprob: torch.Tensor, logprob: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, clip_ratio_low: float, clip_ratio_high: float
                      ) -> torch.Tensor:
    """GSPO's clipped loss on each token (B, T), before aggregation (verl's
    compute_policy_loss_gspo; no dual clip). GSPO's clip range is tiny, e.g. 3e-4 and 4e-4:
    a sequence ratio strays from 1 far less than a token's does."""
    _check_same_shape(old_logprob=old_logprob, logprob=logprob, advantages=advantages, mask=mask)
    low, high = _clip_range(0.0, clip_ratio_low, clip_ratio_high)
    lengths = mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = _masked_sum(logprob - old_logprob, mask, dim=-1) / lengths  # (B,)
    log_ratio = logprob - logprob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(log_ratio, max=_GSPO_LOG_RATIO_MAX))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    return torch.maximum(unclipped, clipped)


# ----------------------------------------------------------------------------- rollout correction
# The sampler's log-probs differ from the trainer's for the same weights the day generation runs
# elsewhere (vLLM, bf16 kernels): truncated or masked importance sampling (TIS / MIS; verl's
# rollout_is, Yao et al. 2025 "Your efficient RL framework secretly brings you off-policy RL
# training") weighs each token's loss by pi_train / pi_rollout, per token, per sequence (the
# product) or per sequence's geometric mean, truncated above a threshold or masked outside
# [lower, upper]; a sequence with a token whose ratio is below the veto threshold is dropped.

@torch.no_grad()
def rollout_is_weights(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor,
                       mask: torch.Tensor, level: str = "token", mode: str = "truncate",
                       threshold: float = 2.0, threshold_lower: float | None = None,
                       veto_threshold: float | None = 1e-4
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(weights (B, T), metrics): verl's compute_rollout_importance_weights (v0.6), detached,
    zero on padding. `old_logprob` is the trainer's, `rollout_logprob` the sampler's; the lower
    threshold defaults to 1 / threshold (mask mode reads it)."""
    _check_same_shape(old_logprob=old_logprob, rollout_logprob=rollout_logprob, mask=mask)
    _check_rollout_is(level, mode, threshold, threshold_lower, veto_threshold)
    _require_tokens(mask, "rollout importance weights")
    lower = 1.0 / threshold if threshold_lower is None else threshold_lower
    log_ratio = old_logprob - rollout_logprob
    if level == "token":
        per = log_ratio
    elif level == "sequence":
        per = _masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1)
    else:
        # a row without tokens gets 0, not verl's 0 / 0: its weights are masked out anyway
        lengths = mask.sum(dim=-1).clamp(min=1)
        per = (_masked_sum(log_ratio, mask, dim=-1) / lengths).unsqueeze(-1)
    raw = torch.exp(torch.clamp(per, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)).expand_as(log_ratio)
    metrics = {"rollout_is/mean": _masked_mean(raw, mask),
               "rollout_is/max": raw.masked_fill(~mask.bool(), float("-inf")).max(),
               "rollout_is/fraction_high": _masked_mean((per > math.log(threshold))
                                                        .expand_as(mask).to(mask.dtype), mask),
               "rollout_is/fraction_low": _masked_mean((per < math.log(lower))
                                                       .expand_as(mask).to(mask.dtype), mask)}
    if mode == "truncate":
        weights = raw.clamp(max=threshold)
    else:
        keep = ((raw >= lower) & (raw <= threshold)).to(raw.dtype)
        metrics["rollout_is/masked_fraction"] = _masked_mean(1 - keep, mask)
        weights = raw * keep
    if veto_threshold is not None:
        vetoed = ((log_ratio < math.log(veto_threshold)) & mask.bool()).any(dim=-1, keepdim=True)
        metrics["rollout_is/vetoed_fraction"] = _masked_mean(
            vetoed.expand_as(mask).to(mask.dtype), mask)
        weights = weights * (~vetoed).to(weights.dtype)
    metrics.update(mismatch_metrics(old_logprob, rollout_logprob, mask))
    return weights * mask, metrics


def _check_rollout_is(level: str, mode: str, threshold: float, lower: float | None,
                      veto: float | None) -> None:
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout_is={level!r}; expected one of {', '.join(ROLLOUT_IS_LEVELS)}")
    if mode not in ROLLOUT_IS_MODES:
        raise ValueError(f"rollout_is_mode={mode!r}; expected one of "
                         f"{', '.join(ROLLOUT_IS_MODES)}")
    if not threshold > 0 or (lower is not None and not 0 < lower <= threshold):
        raise ValueError(f"rollout_is_threshold={threshold}, rollout_is_threshold_lower="
                         f"{lower}: expected 0 < lower <= threshold (importance weights are "
                         f"positive)")
    if veto is not None and not veto > 0:
        raise ValueError(f"rollout_is_veto_threshold={veto}: expected > 0, or None for no veto")


@torch.no_grad()
def mismatch_metrics(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the sampler's log-probs are from the trainer's over the masked tokens: the
    direct estimate of KL(rollout || trainer) and the k3 one (verl's mismatch_kl, k3_kl)."""
    log_ratio = old_logprob - rollout_logprob
    return {"mismatch/kl": _masked_mean(-log_ratio, mask),
            "mismatch/k3_kl": _masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask)}


def entropy_from_logprobs(logprobs: torch.Tensor) -> torch.Tensor:
    """Each position's entropy of the distribution whose log-probs over the vocabulary are
    `logprobs` (..., V): -sum p log p, verl's entropy_from_logits of the same logits."""
    return -(logprobs.exp() * logprobs).sum(dim=-1)


# ----------------------------------------------------------------------------- decoupled PPO
# AReaL's decoupled PPO objective (Fu et al. 2025, "Boosting ... asynchronous RL") for samples
# that older weights generated: the trust region is taken around the proximal policy (the
# weights being trained), not around the stale behaviour policy that sampled, and an importance
# weight prox / behav corrects for sampling from the latter:
#     J = E[ w * min(r * A, clip(r, 1 - eps, 1 + eps) * A) ],  r = pi / prox,  w = prox / behav


def _check_behav_cap(behav_cap: float) -> None:
    # `not >` also catches NaN, which would silently zero or keep every weight
    if not behav_cap > 0:
        raise ValueError(f"behav_cap is {behav_cap}, expected > 0: it caps the importance "
                         f"weight prox / behav of the decoupled PPO objective, which is positive")


def behav_weights(behav_logprob: torch.Tensor, prox_logprob: torch.Tensor, behav_cap: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(capped weights, raw weights) prox / behav per token, both detached: the weight corrects
    for where the samples came from and must not be a direction to optimize."""
    _check_behav_cap(behav_cap)
    log_w = torch.clamp(prox_logprob - behav_logprob, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    raw = torch.exp(log_w).detach()
    # A clamp (truncated importance sampling) rather than AReaL's mask, which drops tokens whose
    # weight exceeds the cap: here they still count, at most behav_cap times.
    return torch.clamp(raw, max=behav_cap), raw


@torch.no_grad()
def decoupled_weight_stats(behav_logprob: torch.Tensor, prox_logprob: torch.Tensor,
                           mask: torch.Tensor, behav_cap: float = LOSS_KNOBS["behav_cap"]
                           ) -> dict[str, torch.Tensor]:
    """Diagnostics of the decoupled objective's importance weights over masked tokens.

    behav_weight_mean: mean capped weight (1 when the samples are fresh); behav_capfrac: share
    of tokens whose weight the cap bound (how stale the samples are beyond the cap)."""
    _check_same_shape(behav_logprob=behav_logprob, prox_logprob=prox_logprob, mask=mask)
    _require_tokens(mask, "decoupled weight statistics")
    weights, raw = behav_weights(behav_logprob, prox_logprob, behav_cap)
    return {"behav_weight_mean": _masked_mean(weights, mask),
            "behav_capfrac": _masked_mean((raw > behav_cap).to(mask.dtype), mask)}


def value_token_losses(values_pred: torch.Tensor, returns: torch.Tensor,
                       values_old: torch.Tensor, mask: torch.Tensor, clip_range: float
                       ) -> torch.Tensor:
    """The clipped value loss of each token (B, T): 0.5 * the larger of the clipped and
    unclipped squared errors.

    The prediction is clipped to within clip_range of the value at rollout time, and taking the
    larger error means moving the value far from the old one never lowers the loss.
    """
    _check_same_shape(values_pred=values_pred, returns=returns, values_old=values_old, mask=mask)
    clipped_pred = torch.maximum(torch.minimum(values_pred, values_old + clip_range),
                                 values_old - clip_range)
    unclipped_error = (values_pred - returns) ** 2
    clipped_error = (clipped_pred - returns) ** 2
    return 0.5 * torch.maximum(unclipped_error, clipped_error)


# ----------------------------------------------------------------------------- KL penalties


def _kl_k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """log(pi/ref): unbiased for KL(pi || ref) on samples of pi, but high variance and signed."""
    return logprob - ref_logprob


def _kl_abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """|log(pi/ref)|: never negative, so it never rewards moving away from the reference."""
    return (logprob - ref_logprob).abs()


def _kl_k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """0.5 * log(pi/ref)^2: low variance, biased."""
    return 0.5 * (logprob - ref_logprob).square()


def _kl_k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """ref/pi - log(ref/pi) - 1: unbiased and non-negative (Schulman's low-variance estimator)."""
    log_ref_ratio = torch.clamp(ref_logprob - logprob, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    estimate = torch.exp(log_ref_ratio) - log_ref_ratio - 1
    return torch.clamp(estimate, -_K3_CLAMP, _K3_CLAMP)


_KL_ESTIMATORS = {"k1": _kl_k1, "abs": _kl_abs, "k2": _kl_k2, "k3": _kl_k3}
KL_KINDS = tuple(_KL_ESTIMATORS)  # flowkit.ops.KL_KINDS, which flows are checked against
_KL_ALIASES = KL_ALIASES


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) of the given kind (one of KL_KINDS)."""
    name = _KL_ALIASES.get(kind, kind)
    if name not in _KL_ESTIMATORS:
        raise ValueError(f"unknown KL kind {kind!r}; expected one of {', '.join(KL_KINDS)} "
                         f"(or verl's aliases {', '.join(_KL_ALIASES)})")
    if logprob.shape != ref_logprob.shape:
        raise ValueError(f"logprob has shape {tuple(logprob.shape)} but ref_logprob has "
                         f"{tuple(ref_logprob.shape)}; expected the same shape")
    return _KL_ESTIMATORS[name](logprob, ref_logprob)
