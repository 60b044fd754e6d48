"""`--precision bf16` end to end on torch executors [Note: mixed precision in
flowkit/dsl/operators.py]: a 30-step pretrain's loss and a 10-step GRPO's learning track fp32's
within 2 %, every forward (training, generation, scoring) under bf16 autocast."""

from __future__ import annotations

import statistics

import pytest

from dataflows.grpo import grpo_flow
from dataflows.pretrain import pretrain_flow
from dataflows.rl.tasks import SORT_GPT, sort_sequences
from flowkit import RunConfig
from tests.harness import pooled_run, tiny_gpt
from tests.torch.rl_ops import even_token_reward

RL_OPS = "tests/torch/rl_ops.py"


def _records(pool, make_flow, steps: int, **config) -> dict[str, list]:
    out = {}
    for precision in ("fp32", "bf16"):
        run = RunConfig(steps=steps, precision=precision, dashboard=False, **config)
        out[precision] = pooled_run(pool, make_flow(), run).records
    return out


def _series(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records]


def test_a_bf16_pretrain_tracks_fp32s_loss(pool):
    flow = lambda: pretrain_flow(  # noqa: E731
        source=sort_sequences, source_config={"digits": 3, "correct_fraction": 0.2},
        batch_size=32, stages=2, microbatches=4, schedule="zb-h1", gpt=SORT_GPT, lr=2e-3)
    runs = _records(pool, flow, 30)
    fp32, bf16 = _series(runs["fp32"], "loss"), _series(runs["bf16"], "loss")
    assert fp32[-1] < 0.5 * fp32[0]  # it learns
    assert all(abs(b - f) <= 0.02 * f for f, b in zip(fp32, bf16)), (fp32, bf16)


@pytest.mark.slow
def test_a_bf16_grpo_learns_as_fp32_does(pool):
    """The sampled tokens part ways after a few steps (bf16 logits sample differently), so
    each step's policy-gradient loss, a zero-mean term of those samples, is not comparable
    step by step; the policy's entropy is, and the rewards rise alike."""
    flow = lambda: grpo_flow(  # noqa: E731
        prompts=8, n=4, stages=2, microbatches=2, max_new_tokens=6, lr=3e-3, kl_coef=0.01,
        schedule="1f1b", gpt={**tiny_gpt(), "seed": 3}, reward=even_token_reward)
    runs = _records(pool, flow, 10, code=[RL_OPS])
    fp32, bf16 = runs["fp32"], runs["bf16"]
    assert _series(fp32, "loss")[:2] == pytest.approx(_series(bf16, "loss")[:2], abs=1e-3)
    entropy = zip(_series(fp32, "update_actor/entropy"), _series(bf16, "update_actor/entropy"))
    assert all(abs(b - f) <= 0.02 * f for f, b in entropy)
    rewards = [statistics.fmean(_series(run, "reward_mean")[-5:]) for run in (fp32, bf16)]
    first = _series(fp32, "reward_mean")[0]
    assert min(rewards) > first + 0.03 and abs(rewards[0] - rewards[1]) < 0.05, rewards
