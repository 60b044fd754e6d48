"""The advantage ops on records (dataflows/rl/advantages.py) against their tensor versions
(reference_algos.py, matched against verl in test_algos.py) on the same samples, plus
hand cases. The ops are called through `.fn`, the plain function the executors run."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dataflows.rl import advantages as adv
from dataflows.rl.ops import gae, make_experience
from flowkit.ops.records import Experience, Scored, TokenScores
from tests.rl import reference_algos as algos

FAST = settings(max_examples=40, deadline=None)
REWARD = st.floats(-5, 5, allow_nan=False)


def _scored(prompt_id: int, sample: int, length: int, reward: float) -> Scored:
    return Scored(prompt_id=prompt_id, sample=sample, prompt_tokens=[1, 2],
                  response_tokens=[7] * length, logprobs=[-0.5] * length, reward=reward)


@st.composite
def samples(draw):
    """A batch of Scored records (reward on the last token) or Experiences carrying arbitrary
    token rewards, in 1-4 prompt groups, responses of 0-5 tokens."""
    carry_token_rewards = draw(st.booleans())
    records, counts = [], {}
    for _ in range(draw(st.integers(1, 8))):
        prompt_id = draw(st.integers(0, 3))
        sample = counts[prompt_id] = counts.get(prompt_id, -1) + 1
        record = _scored(prompt_id, sample, draw(st.integers(0, 5)), draw(REWARD))
        if carry_token_rewards:
            rewards = draw(st.lists(REWARD, min_size=len(record.response_tokens),
                                    max_size=len(record.response_tokens)))
            record = Experience(**attrs.asdict(record, recurse=False), advantages=rewards)
        records.append(record)
    return records


def _padded(records) -> tuple[torch.Tensor, torch.Tensor]:
    """(token rewards, mask), right-padded to the longest response (at least one column)."""
    rows = [adv._token_rewards(r) for r in records]
    width = max([len(row) for row in rows] + [1])
    rewards = torch.tensor([row + [0.0] * (width - len(row)) for row in rows], dtype=torch.float64)
    mask = torch.tensor([[1.0] * len(row) + [0.0] * (width - len(row)) for row in rows],
                        dtype=torch.float64)
    return rewards, mask


def _unpadded(tensor: torch.Tensor, records) -> list[list[float]]:
    return [tensor[i, :len(r.response_tokens)].tolist() for i, r in enumerate(records)]


def _close(got: list[list[float]], want: list[list[float]]) -> None:
    assert [len(row) for row in got] == [len(row) for row in want]
    for g, w in zip(got, want):
        assert g == pytest.approx(w, rel=1e-9, abs=1e-9)


# ----------------------------------------------------------------------------- against tensors


@FAST
@given(records=samples())
def test_rloo_equals_the_tensor_version(records):
    groups: dict[int, list] = {}
    for record in records:
        groups.setdefault(record.prompt_id, []).append(record)
    out = {(e.prompt_id, e.sample): e for group in groups.values()
           for e in adv.rloo_advantages.fn(group)}
    rewards, mask = _padded(records)
    want = algos.rloo_advantages(rewards, mask, [r.prompt_id for r in records])
    got = [out[(r.prompt_id, r.sample)].advantages for r in records]
    _close(got, _unpadded(want, records))


@FAST
@given(records=samples(), gamma=st.floats(0.5, 1.0))
def test_reinforce_pp_equals_the_tensor_version(records, gamma):
    out = adv.reinforce_pp_advantages.fn(records, gamma=gamma)
    rewards, mask = _padded(records)
    if mask.sum() < 2:  # no variance to whiten by: the tensor version refuses, records shift
        assert all(a == 0.0 for e in out for a in e.advantages)
        return
    want, returns = algos.reinforce_pp_advantages(rewards, mask, gamma)
    _close([e.advantages for e in out], _unpadded(want, records))
    _close([e.returns for e in out], _unpadded(returns, records))


@FAST
@given(records=samples())
def test_reinforce_pp_baseline_equals_the_tensor_version(records):
    out = adv.reinforce_pp_baseline_advantages.fn(records)
    rewards, mask = _padded(records)
    if mask.sum() < 2:
        assert all(a == 0.0 for e in out for a in e.advantages)
        return
    want = algos.reinforce_pp_baseline_advantages(rewards, mask,
                                                  [r.prompt_id for r in records])
    _close([e.advantages for e in out], _unpadded(want, records))


@FAST
@given(records=samples(), data=st.data(), gamma=st.floats(0.5, 1.0), lam=st.floats(0.5, 1.0))
def test_gae_equals_the_tensor_version(records, data, gamma, lam):
    """PPO's gae op (dataflows/rl/ops.py) whitens as verl does, like every advantage here."""
    experiences = []
    for record in records:
        rewards = adv._token_rewards(record)
        values = data.draw(st.lists(REWARD, min_size=len(rewards), max_size=len(rewards)))
        experiences.append(Experience(**{**attrs.asdict(record, recurse=False),
                                         "advantages": rewards, "values": values}))
    rewards, mask = _padded(records)
    if mask.sum() < 2:
        return  # no variance to whiten by (the tensor version refuses)
    values = torch.tensor([e.values + [0.0] * (mask.shape[1] - len(e.values))
                           for e in experiences], dtype=torch.float64)
    want, returns = algos.gae_advantages(rewards, values, mask, gamma, lam)
    out = gae.fn(experiences, gamma=gamma, lam=lam)
    _close([e.advantages for e in out], _unpadded(want, records))
    _close([e.returns for e in out], _unpadded(returns, records))


# ----------------------------------------------------------------------------- by hand


def test_rloo_by_hand_with_a_group_of_one():
    group = [_scored(0, i, 2, r) for i, r in enumerate([1.0, 0.0, 0.0, 1.0])]
    got = [e.advantages for e in adv.rloo_advantages.fn(group)]
    # 1 - (0 + 0 + 1) / 3 = 2/3;  0 - (1 + 0 + 1) / 3 = -2/3
    _close(got, [[2 / 3] * 2, [-2 / 3] * 2, [-2 / 3] * 2, [2 / 3] * 2])
    alone = list(adv.rloo_advantages.fn([_scored(5, 0, 3, 0.7)]))
    assert alone[0].advantages == [0.7] * 3  # nothing to leave out: the score itself


def test_kl_token_rewards_by_hand_and_as_ppo_makes_them():
    scored = attrs.evolve(_scored(0, 0, 3, 1.0), logprobs=[-1.0, -2.0, -0.5])
    ref = TokenScores(prompt_id=0, sample=0, values=[-1.5, -1.0, -0.5])
    got = adv.kl_token_rewards.fn(scored, ref, kl_coef=0.1)
    # k1 = 0.5, -1, 0: rewards -0.05, 0.1, 0 + 1 on the last token
    assert got.advantages == pytest.approx([-0.05, 0.1, 1.0])
    assert got.ref_logprobs == [-1.5, -1.0, -0.5]
    values = TokenScores(prompt_id=0, sample=0, values=[0.0] * 3)
    assert make_experience.fn(scored, ref, values, kl_coef=0.1).advantages == got.advantages


def test_reinforce_pp_by_hand():
    """Rewards on the last token only, gamma 1: every token's return is its sample's reward."""
    batch = [_scored(0, 0, 2, 1.0), _scored(1, 0, 3, 0.0)]
    out = adv.reinforce_pp_advantages.fn(batch)
    assert [e.returns for e in out] == [[1.0, 1.0], [0.0, 0.0, 0.0]]
    std = math.sqrt((2 * 0.6 ** 2 + 3 * 0.4 ** 2) / 4 + 1e-8)  # mean 0.4 over 5 tokens
    assert out[0].advantages == pytest.approx([0.6 / std] * 2)
    assert out[1].advantages == pytest.approx([-0.4 / std] * 3)


def test_reinforce_pp_baseline_by_hand():
    """Prompt 0 scores 1 and 0 (centered 0.5, -0.5), prompt 1 alone scores 2 (centered 2)."""
    batch = [_scored(0, 0, 1, 1.0), _scored(0, 1, 1, 0.0), _scored(1, 0, 2, 2.0)]
    out = adv.reinforce_pp_baseline_advantages.fn(batch)
    centered = [0.5, -0.5, 2.0, 2.0]
    mean = sum(centered) / 4
    std = math.sqrt(sum((c - mean) ** 2 for c in centered) / 3 + 1e-8)
    assert [a for e in out for a in e.advantages] == pytest.approx(
        [(c - mean) / std for c in centered])


def test_equal_scores_whiten_to_zero_not_nan():
    out = adv.reinforce_pp_baseline_advantages.fn([_scored(0, i, 2, 1.0) for i in range(3)])
    assert all(a == 0.0 for e in out for a in e.advantages)


def test_an_experience_without_token_rewards_is_refused_with_the_fix():
    """with_reference leaves `advantages` empty: reading them as token rewards would score 0."""
    bare = Experience(**attrs.asdict(_scored(3, 1, 2, 1.0), recurse=False), advantages=[])
    with pytest.raises(ValueError, match=r"prompt_id=3 sample=1 carries 0 token rewards for 2.*"
                                         r"kl_token_rewards"):
        list(adv.rloo_advantages.fn([bare, bare]))


def test_mismatched_reference_log_probs_are_refused():
    ref = TokenScores(prompt_id=0, sample=0, values=[0.0])
    with pytest.raises(ValueError, match="1 reference log-probs for 2 sampled ones"):
        adv.kl_token_rewards.fn(_scored(0, 0, 2, 1.0), ref)
