"""The RL math (reference_algos.py and executors/torch/train/loss_terms.py) against verl: random
inputs vs a transcription of verl, plus hand cases.

The `_verl_*` functions below transcribe verl's `core_algos.py` / `torch_functional.py` formulation
(per-position loops, per-group dicts) so that a vectorization slip in the tensor code cannot hide in
both.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.rl import reference_algos as algos

TOL = dict(rtol=1e-7, atol=1e-7)
F64 = torch.float64


# ----------------------------------------------------------------------------- verl transcriptions


def _verl_masked_mean(values, mask, axis=None):
    return (values * mask).sum(axis=axis) / mask.sum(axis=axis)


def _verl_masked_whiten(values, mask):
    mean = _verl_masked_mean(values, mask)
    variance = _verl_masked_mean((values - mean) ** 2, mask)
    mask_sum = mask.sum()
    variance = variance * (mask_sum / (mask_sum - 1))
    return (values - mean) * torch.rsqrt(variance + 1e-8)


def _verl_gae(token_level_rewards, values, response_mask, gamma, lam, whiten=True):
    nextvalues = 0
    lastgaelam = 0
    advantages_reversed = []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    if whiten:
        advantages = _verl_masked_whiten(advantages, response_mask)
    return advantages, returns


def _verl_grpo(token_level_rewards, response_mask, index, epsilon=1e-6, norm=True):
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx, group in id2score.items():
        if len(group) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            id2mean[idx] = torch.mean(torch.stack(group))
            id2std[idx] = torch.std(torch.stack(group))
    for i in range(scores.shape[0]):
        if norm:
            scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
        else:
            scores[i] = scores[i] - id2mean[index[i]]
    return scores.unsqueeze(-1) * response_mask


def _verl_rloo(token_level_rewards, response_mask, index):
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean = defaultdict(list), {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx, group in id2score.items():
        id2mean[idx] = torch.tensor(0.0) if len(group) == 1 else torch.mean(torch.stack(group))
    for i in range(scores.shape[0]):
        n = len(id2score[index[i]])
        if n > 1:
            scores[i] = scores[i] * n / (n - 1) - id2mean[index[i]] * n / (n - 1)
    return scores.unsqueeze(-1) * response_mask


def _verl_reinforce_pp(token_level_rewards, response_mask, gamma):
    returns = torch.zeros_like(token_level_rewards)
    running_return = 0
    for t in reversed(range(token_level_rewards.shape[1])):
        running_return = token_level_rewards[:, t] + gamma * running_return
        returns[:, t] = running_return
        running_return = running_return * response_mask[:, t]  # reset after EOS
    advantages = _verl_masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


def _verl_reinforce_pp_baseline(token_level_rewards, response_mask, index):
    response_length = token_level_rewards.shape[-1]
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean = defaultdict(list), {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx, group in id2score.items():
        id2mean[idx] = torch.tensor(0.0) if len(group) == 1 else torch.mean(torch.stack(group))
    for i in range(scores.shape[0]):
        scores[i] = scores[i] - id2mean[index[i]]
    scores = scores.unsqueeze(-1).tile([1, response_length]) * response_mask
    return _verl_masked_whiten(scores, response_mask) * response_mask


def _verl_agg_loss(loss_mat, loss_mask, mode, loss_scale_factor=None):
    if mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    if mode == "seq-mean-token-sum":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        return _verl_masked_mean(seq_losses, seq_mask)
    if mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).float()
        return _verl_masked_mean(seq_losses, seq_mask)
    if mode == "seq-mean-token-sum-norm":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        if loss_scale_factor is None:
            loss_scale_factor = loss_mask.shape[-1]
        return torch.sum(seq_losses) / loss_scale_factor
    raise AssertionError(mode)


def _as_ours(verl_loss, loss_mask, mode):
    """verl's aggregate as algos.AGG_MODES define it: the same, except Dr. GRPO's mode, which
    verl leaves summed over responses and the paper (and TRL) averages over them."""
    if mode != "seq-mean-token-sum-norm":
        return verl_loss
    return verl_loss / (loss_mask.sum(dim=-1) > 0).to(loss_mask.dtype).sum()


def _verl_policy_loss(old_log_prob, log_prob, advantages, response_mask, cliprange,
                      clip_ratio_c, mode, cliprange_low=None, cliprange_high=None,
                      rollout_is_weights=None):
    """verl's compute_policy_loss_vanilla (clip-higher and the rollout correction's weights
    too): (loss, clipfrac, ppo_kl, clipfrac_lower)."""
    cliprange_low = cliprange if cliprange_low is None else cliprange_low
    cliprange_high = cliprange if cliprange_high is None else cliprange_high
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = _verl_masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = _verl_masked_mean(torch.gt(pg_losses2, pg_losses1).double(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = _verl_masked_mean(
        torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).double(), response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = _as_ours(_verl_agg_loss(pg_losses, response_mask, mode), response_mask, mode)
    return loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def _verl_value_loss(vpreds, returns, values, response_mask, cliprange_value, mode):
    vpredclipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    loss = 0.5 * _verl_agg_loss(torch.max(vf_losses1, vf_losses2), response_mask, mode)
    return _as_ours(loss, response_mask, mode)


def _verl_kl(logprob, ref_logprob, kind):
    if kind == "k1":
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind == "k2":
        return 0.5 * (logprob - ref_logprob).square()
    kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


# ----------------------------------------------------------------------------- random inputs


@st.composite
def batches(draw, min_tokens: int = 1):
    """(generator, mask) with left-padded, right-padded and gappy rows; >= min_tokens real
    tokens."""
    rows = draw(st.integers(1, 6))
    length = draw(st.integers(1, 7))
    seed = draw(st.integers(0, 2**31 - 1))
    mask = torch.zeros(rows, length, dtype=F64)
    for row in range(rows):
        style = draw(st.sampled_from(["right", "left", "gaps", "full", "empty"]))
        real = draw(st.integers(0, length))
        if style == "right":
            mask[row, :real] = 1
        elif style == "left":
            mask[row, length - real:] = 1
        elif style == "gaps":
            mask[row] = torch.tensor(draw(st.lists(st.sampled_from([0.0, 1.0]),
                                                   min_size=length, max_size=length)), dtype=F64)
        elif style == "full":
            mask[row] = 1
    if mask.sum() < min_tokens:
        mask.view(-1)[:min_tokens] = 1
    return torch.Generator().manual_seed(seed), mask


def _randn(generator, like, scale=1.0):
    return torch.randn(like.shape, generator=generator, dtype=F64) * scale


def _group_labels(draw, rows):
    """Labels with singletons and larger groups, as ints or strings, list or tensor."""
    ints = draw(st.lists(st.integers(0, max(rows // 2, 1)), min_size=rows, max_size=rows))
    form = draw(st.sampled_from(["list", "str", "tensor"]))
    if form == "str":
        return ints, [f"prompt-{i}" for i in ints]
    if form == "tensor":
        return ints, torch.tensor(ints)
    return ints, ints


FAST = settings(max_examples=30, deadline=None)


# ----------------------------------------------------------------------------- against verl


@FAST
@given(batch=batches(min_tokens=2), gamma=st.floats(0.5, 1.0), lam=st.floats(0.0, 1.0),
       whiten=st.booleans())
def test_gae_matches_verl(batch, gamma, lam, whiten):
    generator, mask = batch
    rewards, values = _randn(generator, mask), _randn(generator, mask)
    if whiten and mask.sum() < 2:  # verl divides by zero here; we refuse instead
        with pytest.raises(ValueError, match="at least 2"):
            algos.gae_advantages(rewards, values, mask, gamma, lam)
        return
    got = algos.gae_advantages(rewards, values, mask, gamma, lam, whiten=whiten)
    want = _verl_gae(rewards, values, mask, gamma, lam, whiten=whiten)
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)


@FAST
@given(batch=batches(), norm=st.booleans(), data=st.data())
def test_grpo_matches_verl(batch, norm, data):
    generator, mask = batch
    rewards = _randn(generator, mask)
    ints, labels = _group_labels(data.draw, mask.shape[0])
    got = algos.grpo_advantages(rewards, mask, labels, norm_by_std=norm)
    torch.testing.assert_close(got, _verl_grpo(rewards.clone(), mask, ints, norm=norm), **TOL)


@FAST
@given(batch=batches(), data=st.data())
def test_rloo_matches_verl(batch, data):
    generator, mask = batch
    rewards = _randn(generator, mask)
    ints, labels = _group_labels(data.draw, mask.shape[0])
    got = algos.rloo_advantages(rewards, mask, labels)
    torch.testing.assert_close(got, _verl_rloo(rewards.clone(), mask, ints), **TOL)


@FAST
@given(batch=batches(min_tokens=2), gamma=st.floats(0.5, 1.0))
def test_reinforce_pp_matches_verl(batch, gamma):
    generator, mask = batch
    rewards = _randn(generator, mask)
    if mask.sum() < 2:  # a 1x1 batch: verl divides by zero here; we refuse instead
        with pytest.raises(ValueError, match="at least 2"):
            algos.reinforce_pp_advantages(rewards, mask, gamma)
        return
    got = algos.reinforce_pp_advantages(rewards, mask, gamma)
    want = _verl_reinforce_pp(rewards, mask, gamma)
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)


@FAST
@given(batch=batches(min_tokens=2), data=st.data())
def test_reinforce_pp_baseline_matches_verl(batch, data):
    generator, mask = batch
    rewards = _randn(generator, mask)
    ints, labels = _group_labels(data.draw, mask.shape[0])
    if mask.sum() < 2:
        with pytest.raises(ValueError, match="at least 2"):
            algos.reinforce_pp_baseline_advantages(rewards, mask, labels)
        return
    got = algos.reinforce_pp_baseline_advantages(rewards, mask, labels)
    torch.testing.assert_close(got, _verl_reinforce_pp_baseline(rewards.clone(), mask, ints),
                               **TOL)


@FAST
@given(batch=batches(), agg=st.sampled_from(algos.AGG_MODES), clip=st.floats(0.05, 0.5),
       clip_c=st.floats(1.5, 5.0))
def test_policy_loss_and_stats_match_verl(batch, agg, clip, clip_c):
    generator, mask = batch
    old, new = _randn(generator, mask), _randn(generator, mask, scale=0.5)
    new = old + new  # ratios spread around 1 so all clip regimes occur
    advantages = _randn(generator, mask)
    want = _verl_policy_loss(old, new, advantages, mask, clip, clip_c, agg)
    got = algos.ppo_policy_loss(old, new, advantages, mask, clip, clip_c, agg=agg)
    stats = algos.ppo_policy_loss_stats(old, new, advantages, mask, clip, clip_c)
    torch.testing.assert_close(got, want[0], **TOL)
    torch.testing.assert_close(stats["clipfrac"], want[1], **TOL)
    torch.testing.assert_close(stats["approx_kl"], want[2], **TOL)
    torch.testing.assert_close(stats["clipfrac_lower"], want[3], **TOL)


@FAST
@given(batch=batches(), agg=st.sampled_from(algos.AGG_MODES), clip=st.floats(0.01, 1.0))
def test_value_loss_matches_verl(batch, agg, clip):
    generator, mask = batch
    pred, returns, old = (_randn(generator, mask) for _ in range(3))
    got = algos.value_loss(pred, returns, old, mask, clip, agg=agg)
    torch.testing.assert_close(got, _verl_value_loss(pred, returns, old, mask, clip, agg), **TOL)


@FAST
@given(batch=batches(), kind=st.sampled_from(algos.KL_KINDS), scale=st.sampled_from([0.1, 30.0]))
def test_kl_matches_verl(batch, kind, scale):
    generator, mask = batch
    logprob, ref = _randn(generator, mask, scale), _randn(generator, mask, scale)
    torch.testing.assert_close(algos.kl_penalty(logprob, ref, kind),
                               _verl_kl(logprob, ref, kind), **TOL)


# ----------------------------------------------------------------------------- hand-computed cases


def _t(rows):
    return torch.tensor(rows, dtype=F64)


def test_gae_by_hand_skips_a_masked_gap():
    """gamma=lam=1: the advantage at t is sum of later real rewards + next real value - V_t."""
    rewards, values, mask = _t([[0, 5, 1]]), _t([[1, 9, 2]]), _t([[1, 0, 1]])
    advantages, returns = algos.gae_advantages(rewards, values, mask, 1.0, 1.0, whiten=False)
    # t=2: 1 - 2 = -1;  t=1 (masked): carries -1;  t=0: 0 + 2 - 1 + (-1) = 0
    torch.testing.assert_close(advantages, _t([[0, -1, -1]]))
    torch.testing.assert_close(returns, _t([[1, 8, 1]]))


def test_gae_whitening_gives_mean_0_unbiased_var_1_over_masked_entries():
    generator = torch.Generator().manual_seed(0)
    mask = _t([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    rewards, values = _randn(generator, mask, 3.0), _randn(generator, mask)
    advantages, _ = algos.gae_advantages(rewards, values, mask, 0.99, 0.95)
    real = advantages[mask.bool()]
    assert abs(real.mean().item()) < 1e-12
    assert abs(real.var(unbiased=True).item() - 1) < 1e-6  # 1e-8 eps under the sqrt


def test_grpo_by_hand_with_a_group_of_one():
    rewards = _t([[0, 1], [0, 3], [0, 7]])
    mask = _t([[1, 1], [1, 1], [1, 0]])
    got = algos.grpo_advantages(rewards, mask, ["a", "a", "b"], eps=0.0)
    std = math.sqrt(2.0)  # unbiased std of {1, 3}
    torch.testing.assert_close(got, _t([[-1 / std] * 2, [1 / std] * 2, [7, 0]]))
    unscaled = algos.grpo_advantages(rewards, mask, [0, 0, 1], norm_by_std=False)
    torch.testing.assert_close(unscaled, _t([[-1, -1], [1, 1], [7, 0]]))


def test_rloo_by_hand():
    rewards, mask = _t([[1], [2], [6], [4]]), _t([[1], [1], [1], [1]])
    got = algos.rloo_advantages(rewards, mask, torch.tensor([0, 0, 0, 9]))
    # each minus the mean of the other two; the singleton keeps its score
    torch.testing.assert_close(got, _t([[1 - 4], [2 - 3.5], [6 - 1.5], [4]]))


def test_reinforce_pp_by_hand():
    """gamma 0.5, a padded last position: returns 1 + 0.5 * 2 = 2 and 2; then 3 and 4 tokens
    whiten to mean 0 and unbiased variance ~1."""
    rewards, mask = _t([[1, 2, 0], [3, 0, 4]]), _t([[1, 1, 0], [1, 1, 1]])
    advantages, returns = algos.reinforce_pp_advantages(rewards, mask, gamma=0.5)
    torch.testing.assert_close(returns, _t([[2, 2, 0], [4, 2, 4]]))
    real = [2.0, 2.0, 4.0, 2.0, 4.0]  # mean 2.8, unbiased variance 1.2
    expected = [(r - 2.8) / math.sqrt(1.2 + 1e-8) for r in real]
    torch.testing.assert_close(advantages[mask.bool()], _t(expected))
    assert advantages[0, 2].item() == 0.0


def test_reinforce_pp_baseline_by_hand():
    """Scores 1, 3 (one prompt) and 7 (alone): centered -1, 1 and 7, whitened over 5 tokens."""
    rewards = _t([[0, 1], [0, 3], [7, 0]])
    mask = _t([[1, 1], [1, 1], [1, 0]])
    got = algos.reinforce_pp_baseline_advantages(rewards, mask, ["a", "a", "b"])
    centered = [-1.0, -1.0, 1.0, 1.0, 7.0]
    mean = sum(centered) / 5
    std = math.sqrt(sum((c - mean) ** 2 for c in centered) / 4 + 1e-8)
    torch.testing.assert_close(got[mask.bool()], _t([(c - mean) / std for c in centered]))


def test_policy_loss_dual_clip_caps_negative_advantage():
    """A = -1 with ratio e^2 ~ 7.39: the clipped loss 7.39 is capped at -A * c = 3."""
    old, new, adv, mask = _t([[0.0]]), _t([[2.0]]), _t([[-1.0]]), _t([[1.0]])
    loss = algos.ppo_policy_loss(old, new, adv, mask, clip_ratio=0.2, clip_ratio_c=3.0)
    torch.testing.assert_close(loss, _t(3.0))
    stats = algos.ppo_policy_loss_stats(old, new, adv, mask)
    assert stats["clipfrac_lower"].item() == 1.0
    assert stats["clipfrac"].item() == 0.0  # max(-A*r, -A*clip(r)) took the unclipped term


def test_policy_loss_clips_positive_advantage():
    """A = 1, ratio e^1: the gain is capped at 1.2, so the loss is -1.2."""
    loss = algos.ppo_policy_loss(_t([[0.0]]), _t([[1.0]]), _t([[1.0]]), _t([[1.0]]))
    torch.testing.assert_close(loss, _t(-1.2))


@pytest.mark.parametrize("agg, expected", [
    ("token-mean", (1 + 2 + 3 + 4) / 4),
    ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + 4) / 2),  # the empty row is skipped
    ("seq-mean-token-sum", ((1 + 2 + 3) + 4) / 2),
])
def test_each_agg_mode_by_hand(agg, expected):
    """With A = -1 and ratio 1 the per-token loss is just 1: read losses through the values."""
    losses = _t([[1, 2, 3], [9, 9, 4], [9, 9, 9]])
    mask = _t([[1, 1, 1], [0, 0, 1], [0, 0, 0]])
    zeros = torch.zeros_like(losses)
    got = algos.ppo_policy_loss(zeros, zeros, -losses, mask, agg=agg)
    torch.testing.assert_close(got, _t(expected))
    # value loss with a wide clip is 0.5 * the squared error
    value = algos.value_loss(losses.sqrt(), zeros, zeros, mask, clip_range=100.0, agg=agg)
    torch.testing.assert_close(value, _t(0.5 * expected))


def test_value_loss_takes_the_larger_clipped_error():
    # old 0, clip 1: pred 3 is clipped to 1; return 2 -> errors (3-2)^2 = 1 and (1-2)^2 = 1
    # pred -3 -> clipped -1; return 0 -> unclipped 9 is larger than clipped 1
    pred, ret, old, mask = _t([[3.0, -3.0]]), _t([[2.0, 0.0]]), _t([[0.0, 0.0]]), _t([[1, 1]])
    torch.testing.assert_close(algos.value_loss(pred, ret, old, mask, 1.0), _t(0.5 * (1 + 9) / 2))
    # return 5: clipped error (1-5)^2 = 16 beats unclipped (3-5)^2 = 4
    torch.testing.assert_close(algos.value_loss(_t([[3.0]]), _t([[5.0]]), _t([[0.0]]),
                                                _t([[1.0]]), 1.0), _t(8.0))


@pytest.mark.parametrize("kind, expected", [
    ("k1", [1.0, -2.0, 30.0]),
    ("abs", [1.0, 2.0, 30.0]),
    ("k2", [0.5, 2.0, 450.0]),
    # ref - logprob = -1, 2, -30 (clamped to -20): e^x - x - 1
    ("k3", [math.exp(-1) + 1 - 1, math.exp(2) - 2 - 1, 10.0]),  # e^-20 + 20 - 1 clamps to 10
])
def test_each_kl_kind_by_hand(kind, expected):
    logprob, ref = _t([[1.0, 0.0, 30.0]]), _t([[0.0, 2.0, 0.0]])
    torch.testing.assert_close(algos.kl_penalty(logprob, ref, kind), _t([expected]))


def test_k3_clamps_large_estimates_to_10():
    assert algos.kl_penalty(_t([[0.0]]), _t([[5.0]]), "k3").item() == 10.0


def test_verl_kl_aliases():
    logprob, ref = _t([[0.3]]), _t([[-0.4]])
    for alias, kind in [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")]:
        torch.testing.assert_close(algos.kl_penalty(logprob, ref, alias),
                                   algos.kl_penalty(logprob, ref, kind))


def test_nan_in_padding_does_not_reach_the_loss():
    """A pad token's log-prob can be -inf; the masked reductions must not turn that into NaN."""
    old, new = _t([[0.0, -math.inf]]), _t([[0.1, -math.inf]])
    adv, mask = _t([[1.0, 1.0]]), _t([[1.0, 0.0]])
    for agg in algos.AGG_MODES:
        loss = algos.ppo_policy_loss(old, new, adv, mask, agg=agg, scale_factor=1.0)
        torch.testing.assert_close(loss, _t(-math.exp(0.1)))


def test_losses_carry_gradients():
    logprob = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    loss = algos.ppo_policy_loss(torch.zeros(2, 3, dtype=F64), logprob,
                                 torch.ones(2, 3, dtype=F64), torch.ones(2, 3, dtype=F64))
    loss.backward()
    torch.testing.assert_close(logprob.grad, torch.full((2, 3), -1 / 6, dtype=F64))


# ----------------------------------------------------------------------------- errors


def test_unknown_kl_kind_names_the_known_ones():
    with pytest.raises(ValueError, match="k1, abs, k2, k3"):
        algos.kl_penalty(_t([[0.0]]), _t([[0.0]]), "k4")


def test_unknown_agg_names_the_known_ones():
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-mean, seq-mean-token-sum"):
        algos.ppo_policy_loss(_t([[0.0]]), _t([[0.0]]), _t([[1.0]]), _t([[1.0]]), agg="sum")


def test_shape_errors_list_every_bad_argument():
    with pytest.raises(ValueError, match=r"2 shape error.*values has shape \(2, 4\).*mask"):
        algos.gae_advantages(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(3), 1.0, 1.0)


def test_empty_batch_is_a_shape_error():
    with pytest.raises(ValueError, match="at least one row"):
        algos.grpo_advantages(torch.zeros(0, 2), torch.ones(0, 2), [])


def test_group_index_must_name_every_row():
    with pytest.raises(ValueError, match="group_index has 2 entries, expected one per row"):
        algos.grpo_advantages(torch.zeros(3, 2), torch.ones(3, 2), [0, 1])
    with pytest.raises(ValueError, match="expected 1-D"):
        algos.rloo_advantages(torch.zeros(2, 2), torch.ones(2, 2), torch.zeros(2, 1))


def test_dual_clip_needs_c_above_1():
    with pytest.raises(ValueError, match="clip_ratio_c is 1.0, expected > 1"):
        algos.ppo_policy_loss(_t([[0.0]]), _t([[0.0]]), _t([[1.0]]), _t([[1.0]]),
                              clip_ratio_c=1.0)


def test_whitening_needs_two_tokens():
    with pytest.raises(ValueError, match="at least 2 masked-in token"):
        algos.gae_advantages(_t([[1.0, 2.0]]), _t([[0.0, 0.0]]), _t([[1.0, 0.0]]), 1.0, 1.0)


def test_empty_mask_loss_is_an_error_not_nan():
    with pytest.raises(ValueError, match="mask has 0"):
        algos.value_loss(_t([[1.0]]), _t([[1.0]]), _t([[1.0]]), _t([[0.0]]), 0.2)
