"""The recipes' losses (reference_algos.py, executors/torch/train/loss_terms.py) against
transcriptions of verl (core_algos.py, its v0.6 mismatch_helper.py, torch_functional.py) and TRL
(GRPOTrainer._compute_loss) on random float64 inputs: clip-higher, the four aggregation modes and
their sum form, GSPO's sequence ratio, the rollout correction's weights (TIS / MIS) and mismatch
metrics, token entropy."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.rl import reference_algos as algos
from tests.rl.test_algos import (
    _as_ours,
    _randn,
    _verl_agg_loss,
    _verl_masked_mean,
    _verl_policy_loss,
    batches,
)

F64 = torch.float64
EXACT = dict(rtol=0.0, atol=1e-9)
FAST = settings(max_examples=40, deadline=None)


# ----------------------------------------------------------------------------- transcriptions
def _verl_gspo(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low,
               clip_ratio_high):
    """verl's compute_policy_loss_gspo."""
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = (log_prob - log_prob.detach()
                                + negative_approx_kl_seq.detach().unsqueeze(-1))
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_ratio_low,
                                           1 + clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    return _verl_agg_loss(pg_losses, response_mask, "seq-mean-token-mean")


def _trl_sequence_grpo(per_token_logps, old_per_token_logps, advantages, mask, epsilon_low,
                       epsilon_high):
    """TRL's loss with importance_sampling_level="sequence", loss_type="grpo", beta 0."""
    log_ratio = per_token_logps - old_per_token_logps
    log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    coef_1 = torch.exp(log_importance_weights.unsqueeze(-1))
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def _trl_dr_grpo(per_token_loss, mask, max_completion_length):
    """TRL's loss_type="dr_grpo" normalizer (one process, no accumulation)."""
    return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)


def _verl_rollout_is(old_log_prob, rollout_log_prob, response_mask, level, mode, threshold,
                     threshold_lower, veto_threshold):
    """verl v0.6's compute_rollout_importance_weights: the weights and the metrics flowkit
    reports of it (the token-level means)."""
    upper = threshold
    lower = threshold_lower if threshold_lower is not None else 1.0 / upper
    log_ratio = old_log_prob - rollout_log_prob
    if level == "token":
        per = log_ratio
        weights = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    elif level == "sequence":
        per = (log_ratio * response_mask).sum(-1).unsqueeze(-1)
        weights = torch.exp(torch.clamp(per, min=-20.0, max=20.0)).expand_as(old_log_prob)
    else:
        per = _verl_masked_mean(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        weights = torch.exp(torch.clamp(per, min=-20.0, max=20.0)).expand_as(old_log_prob)
    metrics = {"rollout_is/mean": _verl_masked_mean(weights, response_mask),
               "rollout_is/fraction_high": _verl_masked_mean(
                   (per > math.log(upper)).expand_as(response_mask).double(), response_mask),
               "rollout_is/fraction_low": _verl_masked_mean(
                   (per < math.log(lower)).expand_as(response_mask).double(), response_mask)}
    if level == "token":
        metrics["rollout_is/max"] = weights.masked_fill(~response_mask.bool(), -math.inf).max()
    catastrophic = (log_ratio < math.log(veto_threshold)) & response_mask.bool()
    veto_mask = (~catastrophic.any(dim=-1, keepdim=True)).double()
    if mode == "truncate":
        weights = weights.clamp(max=upper)
    else:
        keep = ((weights >= lower) & (weights <= upper)).double()
        metrics["rollout_is/masked_fraction"] = _verl_masked_mean(1 - keep, response_mask)
        weights = weights * keep
    weights = weights * veto_mask * response_mask
    metrics["mismatch/kl"] = _verl_masked_mean(rollout_log_prob - old_log_prob, response_mask)
    k3 = torch.exp(log_ratio) - log_ratio - 1
    metrics["mismatch/k3_kl"] = _verl_masked_mean(k3, response_mask)
    return weights, metrics


def _verl_entropy_from_logits(logits):
    pd = torch.nn.functional.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


# ----------------------------------------------------------------------------- clip-higher
@FAST
@given(batch=batches(), agg=st.sampled_from(algos.AGG_MODES), low=st.floats(0.05, 0.4),
       high=st.floats(0.05, 0.6), clip_c=st.floats(1.5, 10.0), weighted=st.booleans())
def test_clip_higher_matches_verls_vanilla_policy_loss(batch, agg, low, high, clip_c,
                                                       weighted):
    generator, mask = batch
    old = _randn(generator, mask)
    new = old + _randn(generator, mask, scale=0.5)
    advantages = _randn(generator, mask)
    weights = _randn(generator, mask).abs() if weighted else None
    want, clipfrac, _, _ = _verl_policy_loss(old, new, advantages, mask, 0.2, clip_c, agg,
                                             low, high, weights)
    got = algos.ppo_policy_loss(old, new, advantages, mask, 0.2, clip_c, agg=agg,
                                clip_ratio_low=low, clip_ratio_high=high, weights=weights)
    torch.testing.assert_close(got, want, **EXACT)
    stats = algos.ppo_policy_loss_stats(old, new, advantages, mask, 0.2, clip_c,
                                        clip_ratio_low=low, clip_ratio_high=high)
    torch.testing.assert_close(stats["clipfrac"], clipfrac, **EXACT)


def test_clip_higher_lets_a_positive_advantage_rise_further_than_it_may_fall():
    # ratio 1.25: clipped at 1.2 with the symmetric range, kept with high = 0.28 (DAPO's)
    old, new = torch.zeros(1, 1, dtype=F64), torch.full((1, 1), math.log(1.25), dtype=F64)
    mask, advantage = torch.ones(1, 1, dtype=F64), torch.ones(1, 1, dtype=F64)
    symmetric = algos.ppo_policy_loss(old, new, advantage, mask, 0.2)
    higher = algos.ppo_policy_loss(old, new, advantage, mask, 0.2, clip_ratio_high=0.28)
    assert symmetric.item() == pytest.approx(-1.2) and higher.item() == pytest.approx(-1.25)


# ----------------------------------------------------------------------------- aggregation
@FAST
@given(batch=batches(), agg=st.sampled_from(algos.AGG_MODES), data=st.data())
def test_any_cut_of_the_batch_sums_to_the_whole_batchs_aggregate(batch, agg, data):
    """The sum form: each cut's total and normalizer, summed, give the whole batch's value
    [Note: RL losses in sum form in executors/torch/train/rl_loss.py]."""
    generator, mask = batch
    losses = _randn(generator, mask)
    rows = mask.shape[0]
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(rows - 1, 1)), max_size=3))))
    edges = [0, *[c for c in cuts if c < rows], rows]
    totals = [algos.aggregate_sum(losses[a:b], mask[a:b], agg, scale_factor=7.0)
              for a, b in zip(edges, edges[1:])]
    total = sum(t for t, _ in totals)
    normalizer = sum(n for _, n in totals)
    whole = algos._aggregate(losses, mask, agg, scale_factor=7.0)
    torch.testing.assert_close(total / normalizer, whole, **EXACT)
    want = _verl_agg_loss(losses, mask, agg, loss_scale_factor=7.0)
    torch.testing.assert_close(whole, _as_ours(want, mask, agg), **EXACT)


@FAST
@given(batch=batches(), width=st.integers(1, 64))
def test_dr_grpos_aggregation_is_trls_dr_grpo_loss_on_responses_with_tokens(batch, width):
    generator, mask = batch
    mask = mask[mask.sum(dim=-1) > 0]  # TRL counts every row; a row without tokens is padding
    losses = _randn(generator, mask)
    got = algos._aggregate(losses, mask, "seq-mean-token-sum-norm", scale_factor=width)
    torch.testing.assert_close(got, _trl_dr_grpo(losses, mask, width), **EXACT)


def test_a_non_positive_scale_factor_is_refused():
    ones = torch.ones(1, 2, dtype=F64)
    with pytest.raises(ValueError, match="loss_scale_factor is 0.*max_new_tokens"):
        algos.aggregate_sum(ones, ones, "seq-mean-token-sum-norm", scale_factor=0)


# ----------------------------------------------------------------------------- GSPO
@FAST
@given(batch=batches(), low=st.sampled_from([3e-4, 0.05, 0.2]),
       high=st.sampled_from([4e-4, 0.05, 0.3]), spread=st.sampled_from([1e-4, 0.05, 0.5]))
def test_gspo_matches_verls_loss_and_gradient(batch, low, high, spread):
    generator, mask = batch
    old = _randn(generator, mask)
    noise = _randn(generator, mask, scale=spread)
    advantages = _randn(generator, mask)
    mine = (old + noise).clone().requires_grad_()
    theirs = (old + noise).clone().requires_grad_()
    got = algos.gspo_policy_loss(old, mine, advantages, mask, low, high)
    want = _verl_gspo(old, theirs, advantages, mask, low, high)
    torch.testing.assert_close(got, want, **EXACT)
    got.backward()
    want.backward()
    torch.testing.assert_close(mine.grad, theirs.grad, **EXACT)


@FAST
@given(batch=batches(), spread=st.sampled_from([1e-4, 0.05, 0.5]))
def test_gspos_gradient_is_trls_sequence_level_importance_sampling(batch, spread):
    """verl's stop-gradient form and TRL's exp of the mean log ratio differ in their graphs,
    not in the gradient, for GRPO's advantages (one per response)."""
    generator, mask = batch
    mask = mask[mask.sum(dim=-1) > 0]
    old = _randn(generator, mask)
    new = old + _randn(generator, mask, scale=spread)
    advantages = _randn(generator, mask[:, :1]).expand_as(mask).contiguous()
    mine, theirs = new.clone().requires_grad_(), new.clone().requires_grad_()
    got = algos.gspo_policy_loss(old, mine, advantages, mask, 0.05, 0.08)
    want = _trl_sequence_grpo(theirs, old, advantages, mask, 0.05, 0.08)
    # verl's per-response mean divides by the count + 1e-8, TRL's by the count: 1e-8 apart
    near = dict(rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(got, want, **near)
    got.backward()
    want.backward()
    torch.testing.assert_close(mine.grad * mask, theirs.grad * mask, **near)


# ----------------------------------------------------------------------------- rollout correction
@FAST
@given(batch=batches(), level=st.sampled_from(algos.ROLLOUT_IS_LEVELS),
       mode=st.sampled_from(algos.ROLLOUT_IS_MODES), threshold=st.floats(1.0, 4.0),
       lower=st.one_of(st.none(), st.floats(0.05, 1.0)),
       veto=st.sampled_from([1e-4, 0.3]), spread=st.sampled_from([0.05, 0.5, 3.0]))
def test_rollout_is_weights_and_metrics_match_verl(batch, level, mode, threshold, lower, veto,
                                                   spread):
    generator, mask = batch
    mask = mask[mask.sum(dim=-1) > 0]  # verl's geometric mean is 0 / 0 on a row without tokens
    trainer = _randn(generator, mask) - 1.0
    sampler = trainer + _randn(generator, mask, scale=spread)
    weights, metrics = algos.rollout_is_weights(trainer, sampler, mask, level=level, mode=mode,
                                                threshold=threshold, threshold_lower=lower,
                                                veto_threshold=veto)
    want, want_metrics = _verl_rollout_is(trainer, sampler, mask, level, mode, threshold,
                                          lower, veto)
    torch.testing.assert_close(weights, want, **EXACT)
    for key, value in want_metrics.items():
        torch.testing.assert_close(metrics[key], value, **EXACT, msg=key)
    assert not weights.requires_grad


def test_equal_log_probs_weigh_every_token_one():
    logp = torch.tensor([[-1.0, -2.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=F64)
    for level in algos.ROLLOUT_IS_LEVELS:
        weights, metrics = algos.rollout_is_weights(logp, logp, mask, level=level)
        assert weights.tolist() == [[1.0, 1.0, 0.0]]
        assert metrics["mismatch/kl"].item() == 0.0 == metrics["rollout_is/fraction_high"]


@pytest.mark.parametrize("arguments, message", [
    ({"level": "tokens"}, "rollout_is='tokens'"),
    ({"mode": "clip"}, "rollout_is_mode='clip'"),
    ({"threshold": 2.0, "threshold_lower": 3.0}, "lower <= threshold"),
    ({"veto_threshold": 0.0}, "rollout_is_veto_threshold=0.0"),
])
def test_bad_rollout_correction_settings_say_which(arguments, message):
    ones = torch.ones(1, 2, dtype=F64)
    with pytest.raises(ValueError, match=message):
        algos.rollout_is_weights(ones, ones, ones, **arguments)


# ----------------------------------------------------------------------------- entropy
@FAST
@given(rows=st.integers(1, 4), width=st.integers(1, 5), vocab=st.integers(2, 9),
       seed=st.integers(0, 2**16), scale=st.sampled_from([0.1, 1.0, 20.0]))
def test_entropy_matches_verls_entropy_from_logits(rows, width, vocab, seed, scale):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, vocab, generator=g, dtype=F64) * scale
    got = algos.entropy_from_logprobs(torch.log_softmax(logits, dim=-1))
    torch.testing.assert_close(got, _verl_entropy_from_logits(logits), **EXACT)
