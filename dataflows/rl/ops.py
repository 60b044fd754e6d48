"""Per-sample and per-batch Python ops of the PPO and GRPO flows, on plain lists.

Text is byte-tokenized (token id = byte value) so the arithmetic task needs no tokenizer files.
"""

from __future__ import annotations

import collections
import random
import statistics

import attrs

from dataflows.rl.advantages import whiten, with_advantages
from dataflows.rl.trees import shared_prefix_weights
from flowkit.dsl import Batch, Grouped, Metrics, Stream, op
from flowkit.ops.records import Experience, Prompt, Rollout, Scored, TokenScores

__all__ = ["ARITHMETIC_RESPONSE_TOKENS", "answer_reward", "arithmetic_prompts",
           "check_overlong", "gae", "group_metrics", "grpo_advantages", "make_experience",
           "overlong_penalty", "rollout_metrics", "staleness_metrics", "with_reference"]


ARITHMETIC_RESPONSE_TOKENS = 8
"""The arithmetic task's response length, what its flows pass as max_new_tokens: an answer of up
to 3 digits ("198") and a non-digit that ends it, with room to spare."""


@op
def arithmetic_prompts(*, count: int = 64, seed: int = 0, max_operand: int = 99) -> Stream[Prompt]:
    """Prompts like '17+25=' whose answer a reward function can check exactly."""
    rng = random.Random(seed)
    for prompt_id in range(count):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        yield Prompt(prompt_id=prompt_id, tokens=list(f"{a}+{b}=".encode()), answer=str(a + b))


@op
def answer_reward(rollout: Rollout) -> Scored:
    """1 when the response starts with the exact answer (then a non-digit or the end), else 0."""
    text = bytes(t for t in rollout.response_tokens if 0 <= t < 256).decode(errors="replace")
    answer = rollout.answer or ""
    hit = text.startswith(answer) and not text[len(answer):len(answer) + 1].isdigit()
    return Scored(**attrs.asdict(rollout, recurse=False), reward=1.0 if answer and hit else 0.0)


@op
def make_experience(scored: Scored, ref_logprobs: TokenScores, values: TokenScores, *,
                    kl_coef: float = 0.05) -> Experience:
    """Token rewards: the KL penalty (k1) to the reference on each token, the reward on the last."""
    kl = [lp - ref for lp, ref in zip(scored.logprobs, ref_logprobs.values)]
    token_rewards = [-kl_coef * k for k in kl]
    if token_rewards:
        token_rewards[-1] += scored.reward
    return Experience(**attrs.asdict(scored, recurse=False), advantages=token_rewards,
                      ref_logprobs=ref_logprobs.values, values=values.values)


@op
def gae(experiences: Batch[Experience], *, gamma: float = 1.0, lam: float = 0.95
        ) -> Batch[Experience]:
    """Generalized advantage estimation per sample, then whitening over every token of the batch
    (a batch statistic: the reason this op's input is a barrier). Expects `advantages` to hold the
    token rewards that make_experience put there."""
    raw = [_gae_one(e.advantages, e.values, gamma, lam) for e in experiences]
    out = []
    for exp, advantages, whitened in zip(experiences, raw, whiten(raw)):
        returns = [a + v for a, v in zip(advantages, exp.values)]
        out.append(attrs.evolve(exp, advantages=whitened, returns=returns))
    return out


def _gae_one(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    advantages, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(values) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
    return advantages


@op
def with_reference(scored: Scored, ref_logprobs: TokenScores) -> Experience:
    """A scored sample with its reference log-probabilities (for a KL term in the loss); its
    advantages come later, from its group."""
    fields = attrs.asdict(scored, recurse=False)
    fields.pop("advantages", None)
    return Experience(**{**fields, "ref_logprobs": list(ref_logprobs.values)}, advantages=[])


@op
def grpo_advantages(group: Grouped[Scored], *, eps: float = 1e-6, scale_rewards: bool = True,
                    filter_groups: bool = False, shared_prefix: str = "per_leaf",
                    filter_below: float | None = None) -> Stream[Experience]:
    """Each sample's reward minus its group's mean, over the group's (unbiased) std, on every
    token; a group of one has mean 0 and std 1, as in established GRPO implementations.
    `scale_rewards=False` leaves out the std (Dr. GRPO, Liu et al. 2025: the division favours
    prompts whose rewards barely differ; verl's norm_adv_by_std_in_grpo=False).
    `filter_groups`: a group of two or more whose task rewards (before any shaping, such as
    the overlong penalty: DAPO filters on accuracy) are all equal yields nothing (DAPO's
    dynamic sampling: it teaches nothing about the task, and would only dilute the batch).
    `shared_prefix` says how a tree rollout's leaves train the tokens they share
    (shared_prefix_weights). `filter_below`: a group whose task rewards are all below it yields
    nothing (a prompt no sample solved: DARS's hard prompts, sampled again by a second round
    [Note: second rounds in flowkit/runner/second_round.py])."""
    rewards = [s.reward for s in group]
    tasks = [s.reward if s.task_reward is None else s.task_reward for s in group]
    if filter_groups and len(tasks) > 1 and min(tasks) == max(tasks):
        return
    if filter_below is not None and max(tasks) < filter_below:
        return
    single = len(rewards) == 1
    mean = 0.0 if single else statistics.fmean(rewards)
    std = 1.0 if single else statistics.stdev(rewards)
    weights = shared_prefix_weights(group, shared_prefix)
    for scored in group:
        centered = scored.reward - mean
        advantage = centered / (std + eps) if scale_rewards else centered
        yield with_advantages(scored, [advantage] * len(scored.response_tokens),
                              token_weights=weights.get((scored.prompt_id, scored.sample), []))


@op
def overlong_penalty(scored: Scored, *, max_new_tokens: int = 256, buffer: int = 0,
                     penalty_factor: float = 1.0) -> Scored:
    """DAPO's soft overlong punishment (Yu et al. 2025): a response longer than
    max_new_tokens - buffer tokens loses penalty_factor x (its excess / buffer) of its reward,
    down to -penalty_factor at the full budget; shorter ones keep theirs (verl's
    overlong_buffer_cfg in its DAPO reward manager)."""
    check_overlong(max_new_tokens, buffer)
    exceed = len(scored.response_tokens) - (max_new_tokens - buffer)
    penalty = min(-exceed / buffer * penalty_factor, 0.0)
    task = scored.reward if scored.task_reward is None else scored.task_reward
    return attrs.evolve(scored, reward=scored.reward + penalty, task_reward=task)


def check_overlong(max_new_tokens: int, buffer: int) -> None:
    if not 0 < buffer <= max_new_tokens:
        raise ValueError(f"overlong_buffer={buffer!r} with max_new_tokens={max_new_tokens}: "
                         "the penalty ramps over the last `overlong_buffer` tokens of the "
                         "budget, so it is a whole number from 1 to max_new_tokens (0: off)")


@op
def rollout_metrics(scored: Batch[Scored], *, step: int = 0) -> Metrics:
    """The step's reward and response length, mean and spread, for the dashboard; the share of
    responses the model's context cut short, with a warning when there are any; and how stale
    the trained tokens are (staleness_metrics)."""
    rewards = [s.reward for s in scored] or [0.0]
    lengths = [len(s.response_tokens) for s in scored] or [0]
    clipped = [s for s in scored if s.clipped]
    return Metrics({"reward_mean": statistics.fmean(rewards), "reward_max": max(rewards),
                    "rollout/samples": len(scored),
                    "response_length_mean": statistics.fmean(lengths),
                    "response_length_max": float(max(lengths)),
                    "finished_fraction": statistics.fmean(
                        [float(s.finished) for s in scored] or [0.0]),
                    "response/clipped_fraction": len(clipped) / max(1, len(scored)),
                    "rollout/tokens": sum(_model_tokens(s) for s in scored),
                    **_branch_metrics(scored),
                    **group_metrics(scored), **staleness_metrics(scored, step),
                    **trajectory_metrics(scored)},
                   warnings=[_clipped_warning(clipped)] if clipped else [])


def _branch_metrics(scored: list[Scored]) -> dict:
    """Tree rollouts' share of the step: `rollout/branch_saved_tokens`, the response tokens
    its branches share with the samples they forked from (generated once, not again), and
    `rollout/branches`, how many samples are branches. Nothing without any."""
    branched = [s for s in scored if s.branch_of is not None]
    if not branched:
        return {}
    return {"rollout/branch_saved_tokens": sum(s.shared_tokens for s in branched),
            "rollout/branches": len(branched)}


def _model_tokens(sample: Scored) -> int:
    """The tokens the model generated for a sample (a trajectory's: not the environment's; a
    tree rollout's branch: not those it shares with the sample it forked from, which that one
    generated [Note: tree rollouts in executors/torch/rollout/branching.py])."""
    if sample.response_mask:
        return sum(sample.response_mask)
    return len(sample.response_tokens) - sample.shared_tokens


def group_metrics(samples: list) -> dict:
    """Over the prompts sampled two or more times: the share whose samples' rewards are all
    equal (`groups/zero_advantage_fraction`: a group-relative advantage is 0 for every sample,
    so it trains nothing) and the share of the step's generated tokens they hold
    (`groups/zero_advantage_tokens_fraction`: what they cost); the mean and most samples per
    prompt (they vary with adaptive sampling); and `groups/reward_mean`, the mean over prompts
    of each one's mean reward: the policy's reward on the step's prompts whatever their samples
    (reward_mean weighs a prompt by its samples). Nothing when each prompt has one."""
    rewards: dict[int, list[float]] = collections.defaultdict(list)
    tokens: dict[int, int] = collections.defaultdict(int)
    for s in samples:
        rewards[s.prompt_id].append(s.reward)
        tokens[s.prompt_id] += _model_tokens(s)
    groups = [p for p, r in rewards.items() if len(r) > 1]
    if not groups:
        return {}
    zero = [p for p in groups if min(rewards[p]) == max(rewards[p])]
    return {"groups/zero_advantage_fraction": len(zero) / len(groups),
            "groups/zero_advantage_tokens_fraction": sum(tokens[p] for p in zero)
            / max(1, sum(tokens.values())),
            "groups/samples_mean": statistics.fmean(len(r) for r in rewards.values()),
            "groups/samples_max": float(max(len(r) for r in rewards.values())),
            "groups/reward_mean": statistics.fmean(statistics.fmean(r)
                                                   for r in rewards.values())}


def trajectory_metrics(samples: list) -> dict:
    """Of multi-turn trajectories [Note: multi-turn rollouts in flowkit/ops/environments.py]:
    model turns per trajectory, the model's tokens per turn, the environment's tokens per
    trajectory, and the share its environment ended early (a step that raised or timed out).
    Nothing for single responses."""
    trajectories = [s for s in samples if s.response_mask]
    if not trajectories:
        return {}
    turns = [s.turns for s in trajectories]
    model = [sum(s.response_mask) for s in trajectories]
    errors = [s.env_error for s in trajectories if s.env_error is not None]
    keys = sorted({key for s in trajectories for key in s.env_info})
    return {"agent/turns_mean": statistics.fmean(turns), "agent/turns_max": float(max(turns)),
            "agent/model_tokens_per_turn": sum(model) / max(1, sum(turns)),
            "agent/env_tokens_mean": statistics.fmean(
                len(s.response_mask) - m for s, m in zip(trajectories, model)),
            "agent/env_error_fraction": len(errors) / len(trajectories),
            "agent/env_timeout_fraction": sum("env_timeout_s" in e for e in errors)
            / len(trajectories),
            # each number the environments report, a mean over the trajectories (0 where one
            # did not report it): env_seconds, a tool environment's tool_calls, ...
            **{f"agent/{key}_mean": statistics.fmean(float(s.env_info.get(key, 0.0))
                                                      for s in trajectories) for key in keys}}


def staleness_metrics(samples: list, step: int) -> dict:
    """Over the response tokens trained at `step` (which updates weights version `step`: one
    optimizer step per step): how many versions older the weights that sampled each token
    were (`staleness/mean`, `staleness/max`), and tokens per sampling version
    (`staleness/versions`, a histogram). Versions before the first weights load (-1) are the
    weights the run started from, version 0. Nothing for samples without versions."""
    versions = [max(0, v) for s in samples for v in s.versions]
    if not versions:
        return {}
    lags = [step - v for v in versions]
    histogram = collections.Counter(versions)
    return {"staleness/mean": statistics.fmean(lags), "staleness/max": float(max(lags)),
            "staleness/versions": {str(v): histogram[v] for v in sorted(histogram)}}


def _clipped_warning(clipped: list[Scored]) -> str:
    longest = max(len(s.prompt_tokens) + len(s.response_tokens) for s in clipped)
    return (f"responses were cut by the model's context ({longest} tokens with the prompt) "
            "before EOS or max_new_tokens; their rewards see a truncated answer. Use shorter "
            "prompts, a smaller max_new_tokens, or a model with a longer context "
            "(response/clipped_fraction says how many)")
