"""The RL math's tensor reference, for tests only: the advantage estimators (GAE, GRPO, RLOO,
REINFORCE++) and whole losses (PPO, GSPO, decoupled PPO, the value loss, verl's loss
aggregation) on padded (batch, response_length) tensors, as verl's `core_algos.py` computes them
(test_algos.py matches them against a transcription of verl). dataflows/rl/advantages.py's
record versions and the torch executor's RL loss are tested against them. The per-token terms
the executor trains with are executors/torch/train/loss_terms.py's, imported here and re-exported,
so that a test reads all of the math as `reference_algos.X`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from executors.torch.train.loss_terms import (
    AGG_MODES,
    KL_KINDS,
    ROLLOUT_IS_LEVELS,
    ROLLOUT_IS_MODES,
    _check_agg,
    _check_same_shape,
    _masked_mean,
    _masked_sum,
    _ppo_stats,
    _ppo_token_terms,
    _require_tokens,
    aggregate_sum,
    behav_weights,
    decoupled_weight_stats,
    entropy_from_logprobs,
    gspo_token_losses,
    kl_penalty,
    mismatch_metrics,
    ppo_token_losses_and_stats,
    rollout_is_weights,
    value_token_losses,
)
from flowkit.ops import LOSS_KNOBS

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_IS_MODES",
    "aggregate_sum",
    "behav_weights",
    "decoupled_ppo_policy_loss",
    "decoupled_weight_stats",
    "entropy_from_logprobs",
    "gae_advantages",
    "grpo_advantages",
    "gspo_policy_loss",
    "gspo_token_losses",
    "kl_penalty",
    "mismatch_metrics",
    "ppo_policy_loss",
    "ppo_policy_loss_stats",
    "ppo_token_losses",
    "ppo_token_losses_and_stats",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "rollout_is_weights",
    "value_loss",
    "value_token_losses",
]

# verl's whitening divides by sqrt(var + 1e-8) rather than sqrt(var): a batch of equal advantages
# then whitens to zeros instead of NaN.
_WHITEN_EPS = 1e-8


GroupIndex = torch.Tensor | Sequence[int] | Sequence[str]


def _group_ids(group_index: GroupIndex, batch: int, device: torch.device) -> torch.Tensor:
    """Dense ids 0..G-1 (B,) for any labelling of rows by prompt: a tensor, ints or strings."""
    if isinstance(group_index, torch.Tensor):
        if group_index.dim() != 1:
            raise ValueError(f"group_index has shape {tuple(group_index.shape)}, expected 1-D "
                             f"(batch,) naming each row's prompt")
        labels = group_index.tolist()
    else:
        labels = list(group_index)
    if len(labels) != batch:
        raise ValueError(f"group_index has {len(labels)} entries, expected one per row ({batch})")
    dense: dict[object, int] = {}
    ids = [dense.setdefault(label, len(dense)) for label in labels]
    return torch.tensor(ids, dtype=torch.long, device=device)


def _masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Shift to mean 0 and scale to unbiased variance ~1 over the masked entries (verl's)."""
    _require_tokens(mask, "whitening (unbiased variance)", at_least=2)
    mean = _masked_mean(values, mask)
    count = mask.sum()
    variance = _masked_mean((values - mean) ** 2, mask) * count / (count - 1)
    return (values - mean) * torch.rsqrt(variance + _WHITEN_EPS)


@torch.no_grad()
def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   gamma: float, lam: float, whiten: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation; returns (advantages, returns), both (B, T).

    The recursion runs right to left over every position. At a masked-out position the TD error
    is computed but not kept: the next value and the running advantage carry over it unchanged,
    so padding (or an observation token) between two response tokens is skipped, as in verl.
    `returns` are the raw advantages plus `values`; whitening touches only the advantages, with
    statistics over masked-in entries. Padded positions keep their (carried) values rather than
    zeros, as in verl: the losses mask them out.
    """
    _check_same_shape(token_rewards=token_rewards, values=values, mask=mask)
    next_value = torch.zeros_like(values[:, 0])  # (B,)
    running = torch.zeros_like(values[:, 0])  # (B,)
    reversed_advantages = []
    for t in reversed(range(token_rewards.shape[1])):
        keep = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * running
        next_value = values[:, t] * keep + (1 - keep) * next_value
        running = candidate * keep + (1 - keep) * running
        reversed_advantages.append(running)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)  # (B, T)
    returns = advantages + values
    if whiten:
        advantages = _masked_whiten(advantages, mask)
    return advantages, returns


def _sequence_scores(token_rewards: torch.Tensor, mask: torch.Tensor,
                     group_index: GroupIndex) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scores (B,), dense group ids (B,), group sizes per row (B,)) of the outcome estimators."""
    _check_same_shape(token_rewards=token_rewards, mask=mask)
    scores = token_rewards.sum(dim=-1)  # outcome reward: one scalar per response
    ids = _group_ids(group_index, scores.shape[0], scores.device)
    sizes = torch.bincount(ids).to(scores.dtype)  # (G,)
    return scores, ids, sizes[ids]


def _group_mean(scores: torch.Tensor, ids: torch.Tensor, row_sizes: torch.Tensor) -> torch.Tensor:
    """Mean score of each row's group, per row (B,)."""
    sums = torch.zeros(int(ids.max()) + 1, dtype=scores.dtype, device=scores.device)
    sums.index_add_(0, ids, scores)
    return sums[ids] / row_sizes


def _group_std(scores: torch.Tensor, ids: torch.Tensor, row_sizes: torch.Tensor,
               row_means: torch.Tensor) -> torch.Tensor:
    """Unbiased std of each row's group, per row (B,); only meaningful for groups of 2 or more."""
    squares = torch.zeros(int(ids.max()) + 1, dtype=scores.dtype, device=scores.device)
    squares.index_add_(0, ids, (scores - row_means) ** 2)
    return torch.sqrt(squares[ids] / (row_sizes - 1).clamp(min=1))


@torch.no_grad()
def grpo_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, group_index: GroupIndex,
                    eps: float = 1e-6, norm_by_std: bool = True) -> torch.Tensor:
    """GRPO: each response's score against the mean (and std) of its prompt's group, (B, T).

    A prompt with a single response has nothing to compare with; verl then uses mean 0 and std 1,
    so the advantage is the score itself (divided by 1 + eps). Without `norm_by_std` this is
    Dr. GRPO's unscaled advantage.
    """
    scores, ids, row_sizes = _sequence_scores(token_rewards, mask, group_index)
    alone = row_sizes == 1
    mean = torch.where(alone, torch.zeros_like(scores), _group_mean(scores, ids, row_sizes))
    centered = scores - mean
    if norm_by_std:
        std = torch.where(alone, torch.ones_like(scores),
                          _group_std(scores, ids, row_sizes, mean))
        centered = centered / (std + eps)
    return centered.unsqueeze(-1) * mask


@torch.no_grad()
def rloo_advantages(token_rewards: torch.Tensor, mask: torch.Tensor,
                    group_index: GroupIndex) -> torch.Tensor:
    """RLOO: each score minus the mean of the *other* responses to its prompt, (B, T).

    score - (n * mean - score) / (n - 1) rearranges to n/(n-1) * (score - mean), which is how
    verl writes it. A prompt with one response keeps its raw score.
    """
    scores, ids, row_sizes = _sequence_scores(token_rewards, mask, group_index)
    mean = _group_mean(scores, ids, row_sizes)
    scale = row_sizes / (row_sizes - 1).clamp(min=1)
    left_out = scores * scale - mean * scale
    advantages = torch.where(row_sizes > 1, left_out, scores)
    return advantages.unsqueeze(-1) * mask


@torch.no_grad()
def reinforce_pp_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted returns of the token rewards, whitened over the batch's masked
    tokens; returns (advantages, returns), both (B, T).

    No critic: the return-to-go is the advantage, and whitening over every token of the batch
    is its baseline. A masked-out position ends the running sum (verl's "reset after EOS"), so
    padding to the right of a response cannot feed rewards into it.
    """
    _check_same_shape(token_rewards=token_rewards, mask=mask)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])  # (B,)
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return _masked_whiten(returns, mask) * mask, returns


@torch.no_grad()
def reinforce_pp_baseline_advantages(token_rewards: torch.Tensor, mask: torch.Tensor,
                                     group_index: GroupIndex) -> torch.Tensor:
    """REINFORCE++-baseline: each score minus its prompt group's mean (a group of one: minus 0,
    as in GRPO), on every token, then whitened over the batch's masked tokens, (B, T)."""
    scores, ids, row_sizes = _sequence_scores(token_rewards, mask, group_index)
    mean = torch.where(row_sizes == 1, torch.zeros_like(scores),
                       _group_mean(scores, ids, row_sizes))
    centered = (scores - mean).unsqueeze(-1) * mask
    return _masked_whiten(centered, mask) * mask


def _seq_mean_over_nonempty(seq_losses: torch.Tensor, token_counts: torch.Tensor) -> torch.Tensor:
    """Mean of per-sequence losses over rows that have any token (fully padded rows are skipped)."""
    nonempty = (token_counts > 0).to(seq_losses.dtype)
    return (seq_losses * nonempty).sum() / nonempty.sum()


def _agg_token_mean(losses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Every real token weighs the same: long responses dominate."""
    return _masked_mean(losses, mask)


def _agg_seq_mean_token_mean(losses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Every response weighs the same, its tokens averaged first."""
    counts = mask.sum(dim=-1)
    # verl's +1e-8 keeps fully padded rows finite (they are skipped below) and is kept here so
    # that the two agree to the last digits.
    seq_losses = _masked_sum(losses, mask, dim=-1) / (counts + 1e-8)
    return _seq_mean_over_nonempty(seq_losses, counts)


def _agg_seq_mean_token_sum(losses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Every response weighs the same, its tokens summed."""
    return _seq_mean_over_nonempty(_masked_sum(losses, mask, dim=-1), mask.sum(dim=-1))


def _aggregate(losses: torch.Tensor, mask: torch.Tensor, agg: str,
               scale_factor: float | None = None) -> torch.Tensor:
    """Reduce per-token losses (B, T) to a scalar with one of AGG_MODES (verl's agg_loss)."""
    _check_agg(agg)
    _require_tokens(mask, f"loss aggregation {agg!r}")
    if agg == "token-mean":
        return _agg_token_mean(losses, mask)
    if agg == "seq-mean-token-mean":
        return _agg_seq_mean_token_mean(losses, mask)
    if agg == "seq-mean-token-sum":
        return _agg_seq_mean_token_sum(losses, mask)
    total, rows = aggregate_sum(losses, mask, agg, scale_factor)
    return total / rows


def ppo_token_losses(old_logprob: torch.Tensor, logprob: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor, clip_ratio: float = 0.2, clip_ratio_c: float = 3.0, *,
                     clip_ratio_low: float | None = None, clip_ratio_high: float | None = None
                     ) -> torch.Tensor:
    """The dual-clip PPO loss of each token (B, T), before aggregation."""
    return _ppo_token_terms(old_logprob, logprob, advantages, mask, clip_ratio, clip_ratio_c,
                            clip_ratio_low, clip_ratio_high)["losses"]


def ppo_policy_loss(old_logprob: torch.Tensor, logprob: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, clip_ratio: float = 0.2, clip_ratio_c: float = 3.0,
                    agg: str = "token-mean", *, clip_ratio_low: float | None = None,
                    clip_ratio_high: float | None = None, weights: torch.Tensor | None = None,
                    scale_factor: float | None = None) -> torch.Tensor:
    """Clipped surrogate loss with the dual clip for negative advantages (a scalar to minimize);
    `weights` (detached, e.g. rollout_is_weights) multiply each token's loss after the clips,
    as verl's compute_policy_loss_vanilla applies its rollout correction."""
    losses = ppo_token_losses(old_logprob, logprob, advantages, mask, clip_ratio, clip_ratio_c,
                              clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high)
    return _aggregate(losses if weights is None else losses * weights, mask, agg, scale_factor)


@torch.no_grad()
def ppo_policy_loss_stats(old_logprob: torch.Tensor, logprob: torch.Tensor,
                          advantages: torch.Tensor, mask: torch.Tensor, clip_ratio: float = 0.2,
                          clip_ratio_c: float = 3.0, *, clip_ratio_low: float | None = None,
                          clip_ratio_high: float | None = None) -> dict[str, torch.Tensor]:
    """Diagnostics of the PPO step over masked tokens, as verl logs them.

    clipfrac: share of tokens where the ratio clip bound; clipfrac_lower: share where the dual
    clip bound (negative advantages only); approx_kl: mean of old_logprob - logprob.
    """
    terms = _ppo_token_terms(old_logprob, logprob, advantages, mask, clip_ratio, clip_ratio_c,
                             clip_ratio_low, clip_ratio_high)
    return _ppo_stats(terms, advantages, mask)


def gspo_policy_loss(old_logprob: torch.Tensor, logprob: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor, clip_ratio_low: float = 3e-4,
                     clip_ratio_high: float = 4e-4, agg: str = "seq-mean-token-mean", *,
                     weights: torch.Tensor | None = None) -> torch.Tensor:
    """GSPO's loss, a scalar to minimize; verl always aggregates it seq-mean-token-mean (the
    per-response mean is what makes the ratio a sequence's)."""
    losses = gspo_token_losses(old_logprob, logprob, advantages, mask, clip_ratio_low,
                               clip_ratio_high)
    return _aggregate(losses if weights is None else losses * weights, mask, agg)


def decoupled_ppo_policy_loss(behav_logprob: torch.Tensor, prox_logprob: torch.Tensor,
                              logprob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                              clip_ratio: float = 0.2, clip_ratio_c: float = 3.0,
                              behav_cap: float = LOSS_KNOBS["behav_cap"],
                              agg: str = "token-mean") -> torch.Tensor:
    """AReaL's decoupled PPO objective (Fu et al. 2025), a scalar to minimize: the dual-clip
    PPO loss of `logprob` against `prox_logprob`, each token's loss times the detached weight
    min(exp(prox_logprob - behav_logprob), behav_cap) before aggregation.

    `behav_logprob` is what the sampler recorded (the behaviour policy), `prox_logprob` the
    log-probs of the weights before this update. With prox == behav the weight is exactly 1
    and this is ppo_policy_loss(behav_logprob, ...). The cap clamps larger weights to it
    (truncated importance sampling); AReaL instead masks those tokens out."""
    _check_same_shape(behav_logprob=behav_logprob, prox_logprob=prox_logprob, logprob=logprob,
                      advantages=advantages, mask=mask)
    weights, _ = behav_weights(behav_logprob, prox_logprob, behav_cap)
    terms = _ppo_token_terms(prox_logprob, logprob, advantages, mask, clip_ratio, clip_ratio_c)
    return _aggregate(weights * terms["losses"], mask, agg)


def value_loss(values_pred: torch.Tensor, returns: torch.Tensor, values_old: torch.Tensor,
               mask: torch.Tensor, clip_range: float, agg: str = "token-mean") -> torch.Tensor:
    """Clipped value loss (value_token_losses), aggregated."""
    return _aggregate(value_token_losses(values_pred, returns, values_old, mask, clip_range),
                      mask, agg)
