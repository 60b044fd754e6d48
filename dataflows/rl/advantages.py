"""Critic-free advantage estimators on records: RLOO per prompt group, REINFORCE++ and
REINFORCE++-baseline over the batch, and the token rewards they read, with the KL penalty to
the reference folded in. Each equals its tensor version in tests/rl/reference_algos.py (verl's
formulas) on the same samples, right-padded (tests/rl/test_advantages.py).

[Note: token rewards] A sample's token rewards are what the estimators start from, as verl's
`token_level_rewards`: an Experience carries them in `advantages` (kl_token_rewards and PPO's
make_experience put them there; the estimator replaces them with the advantages), a plain
Scored has its reward on its last token and 0 elsewhere. The outcome estimators (RLOO, the
baseline variant) score a sample by the sum of its token rewards: its reward minus
kl_coef x its summed k1 KL, the KL penalty in the reward.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

import attrs

from dataflows.rl.trees import shared_prefix_weights
from flowkit.dsl import Batch, Grouped, Stream, op
from flowkit.ops.records import Experience, Scored, TokenScores

__all__ = ["kl_token_rewards", "reinforce_pp_advantages", "reinforce_pp_baseline_advantages",
           "rloo_advantages", "whiten", "with_advantages"]

# verl whitens with rsqrt(var + 1e-8): equal advantages whiten to 0 rather than NaN
_WHITEN_EPS = 1e-8


@op
def kl_token_rewards(scored: Scored, ref_logprobs: TokenScores, *, kl_coef: float = 0.001
                     ) -> Experience:
    """The KL penalty in the reward: -kl_coef x the k1 estimate (sampler's log-prob minus the
    reference's) on each token, plus the reward on the last, in `advantages` until an
    estimator replaces them [Note: token rewards]; the reference log-probs are kept."""
    refs = list(ref_logprobs.values)
    if len(refs) != len(scored.logprobs):
        raise ValueError(f"sample {_name(scored)} has {len(refs)} reference log-probs for "
                         f"{len(scored.logprobs)} sampled ones; they must match")
    token_rewards = [-kl_coef * (lp - ref) for lp, ref in zip(scored.logprobs, refs)]
    if token_rewards:
        token_rewards[-1] += scored.reward
    fields = {**attrs.asdict(scored, recurse=False), "ref_logprobs": refs}
    fields.pop("advantages", None)
    return Experience(**fields, advantages=token_rewards)


@op
def rloo_advantages(group: Grouped[Scored], *, shared_prefix: str = "per_leaf"
                    ) -> Stream[Experience]:
    """RLOO: each sample's score minus the mean score of the other n-1 samples of its prompt,
    on every token. A group of one has no other sample and keeps its score (as verl)."""
    scores = [sum(_token_rewards(s)) for s in group]
    n, total = len(scores), sum(scores)
    weights = shared_prefix_weights(group, shared_prefix)
    for record, score in zip(group, scores):
        advantage = score if n == 1 else score - (total - score) / (n - 1)
        yield with_advantages(record, [advantage] * len(record.response_tokens),
                              token_weights=weights.get((record.prompt_id, record.sample), []))


@op
def reinforce_pp_advantages(experiences: Batch[Scored], *, gamma: float = 1.0
                            ) -> Batch[Experience]:
    """REINFORCE++: each token's discounted return (the sum of its own and later token rewards,
    discounted by `gamma`), whitened over every token of the batch (the batch statistic that
    replaces a critic: the reason this op's input is a barrier). `returns` keeps the raw
    returns."""
    returns = [_returns_to_go(_token_rewards(e), gamma) for e in experiences]
    return [with_advantages(e, advantages, returns=r)
            for e, advantages, r in zip(experiences, whiten(returns), returns)]


@op
def reinforce_pp_baseline_advantages(experiences: Batch[Scored]) -> Batch[Experience]:
    """REINFORCE++-baseline: each sample's score minus its prompt's mean score (a prompt with
    one sample: minus 0, as GRPO), on every token, then whitened over every token of the
    batch."""
    scores = [sum(_token_rewards(e)) for e in experiences]
    by_prompt: dict[int, list[float]] = defaultdict(list)
    for e, score in zip(experiences, scores):
        by_prompt[e.prompt_id].append(score)
    means = {p: 0.0 if len(s) == 1 else statistics.fmean(s) for p, s in by_prompt.items()}
    centered = [[score - means[e.prompt_id]] * len(e.response_tokens)
                for e, score in zip(experiences, scores)]
    return [with_advantages(e, advantages)
            for e, advantages in zip(experiences, whiten(centered))]


def _token_rewards(record: Scored) -> list[float]:
    """[Note: token rewards]"""
    if isinstance(record, Experience):
        if len(record.advantages) != len(record.response_tokens):
            raise ValueError(
                f"sample {_name(record)} carries {len(record.advantages)} token rewards for "
                f"{len(record.response_tokens)} response tokens: make its Experience with "
                "kl_token_rewards (or pass the Scored records, reward on the last token)")
        return list(record.advantages)
    rewards = [0.0] * len(record.response_tokens)
    if rewards:
        rewards[-1] = record.reward
    return rewards


def _returns_to_go(rewards: list[float], gamma: float) -> list[float]:
    returns, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        running = rewards[t] + gamma * running
        returns[t] = running
    return returns


def whiten(rows: list[list[float]]) -> list[list[float]]:
    """Shift to mean 0 and scale to unbiased variance ~1 over every value of every row (verl's
    masked_whiten). Under two values there is no variance: they only shift, to 0."""
    flat = [v for row in rows for v in row]
    if len(flat) < 2:
        return [[0.0] * len(row) for row in rows]
    mean = statistics.fmean(flat)
    variance = sum((v - mean) ** 2 for v in flat) / (len(flat) - 1)
    scale = 1.0 / math.sqrt(variance + _WHITEN_EPS)
    return [[(v - mean) * scale for v in row] for row in rows]


def with_advantages(record: Scored, advantages: list[float], *,
                    returns: list[float] | None = None,
                    token_weights: list[float] | None = None) -> Experience:
    """`record` as an Experience with these advantages (and returns, token weights)."""
    extra = {} if returns is None else {"returns": returns}
    if token_weights:
        extra["token_weights"] = token_weights
    if isinstance(record, Experience):
        return attrs.evolve(record, advantages=advantages, **extra)
    return Experience(**attrs.asdict(record, recurse=False), advantages=advantages, **extra)


def _name(record: Scored) -> str:
    return f"prompt_id={record.prompt_id} sample={record.sample}"
