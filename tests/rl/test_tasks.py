"""The sorting task's ops: exact-match reward, per-step prompts, warm-up sequences."""

from __future__ import annotations

import pytest
import torch

from dataflows.model_ops import Backprop, Generate, OptimizerStep
from dataflows.rl.tasks import (
    EOS,
    SORT_GPT,
    sft_targets,
    sort_answer,
    sort_prompts,
    sort_reward,
    sort_sequences,
)
from flowkit.dsl import Flow, Model, collect
from flowkit.ops.records import Rollout, Scored
from flowkit.planner.lower import lower_flow

GPT = "executors.torch.models.gpt:GPT"


def _rollout(response: bytes | list[int], *, answer: str | None = "1349", finished=True):
    tokens = list(response)
    return Rollout(prompt_id=3, sample=1, prompt_tokens=list(b"sort 4193:"),
                   response_tokens=tokens, logprobs=[-0.5] * len(tokens), finished=finished,
                   answer=answer)


# -- reward -------------------------------------------------------------------------------------
def test_the_exact_answer_then_eos_scores_one_and_keeps_the_rollout():
    rollout = _rollout(b"1349\n")
    scored = sort_reward.fn(rollout)
    assert isinstance(scored, Scored) and scored.reward == 1.0
    assert (scored.prompt_id, scored.sample, scored.logprobs) == (3, 1, [-0.5] * 5)
    assert scored.response_tokens == list(b"1349\n") and scored.answer == "1349"


@pytest.mark.parametrize("response, finished", [
    (b"1349", False),        # cut at max_new_tokens: no EOS
    (b"1349\n5", False),     # anything after EOS (a generator without eos)
    (b"1349 \n", True),      # trailing text before EOS
    (b"13490\n", True),      # one more digit
    (b"134\n", True),        # one digit short
    (b"9431\n", True),       # sorted the wrong way
    (b"1394\n", True),       # not sorted
    (b" 1349\n", True),      # leading text
    (b"\n", True),           # empty answer
    (b"", False),            # nothing at all
])
def test_anything_but_the_exact_answer_then_eos_scores_zero(response, finished):
    assert sort_reward.fn(_rollout(response, finished=finished)).reward == 0.0


def test_a_rollout_without_an_answer_scores_zero():
    assert sort_reward.fn(_rollout(b"\n", answer=None)).reward == 0.0
    assert sort_reward.fn(_rollout(b"\n", answer="")).reward == 0.0


def test_reward_ignores_tokens_outside_bytes_rather_than_failing():
    assert sort_reward.fn(_rollout([ord("1"), 300, EOS])).reward == 0.0


# -- prompts ------------------------------------------------------------------------------------
def _prompts(**kw):
    return list(sort_prompts.fn(**{"count": 16, **kw}))


def test_prompts_are_sort_requests_with_their_sorted_answer():
    prompts = _prompts(count=50, digits=4)
    assert [p.prompt_id for p in prompts] == list(range(50))
    for p in prompts:
        text = bytes(p.tokens).decode()
        assert text.startswith("sort ") and text.endswith(":") and len(text) == 10
        shown = text[5:-1]
        assert shown.isdigit() and p.answer == "".join(sorted(shown))
        assert all(t < 128 for t in p.tokens)  # fits a GPT with vocab_size 128


def test_prompts_are_deterministic_per_seed_and_step():
    assert _prompts(seed=1, step=5) == _prompts(seed=1, step=5)


def test_prompts_differ_across_steps_and_seeds():
    base = [p.tokens for p in _prompts(seed=0, step=0)]
    assert base != [p.tokens for p in _prompts(seed=0, step=1)]
    assert base != [p.tokens for p in _prompts(seed=1, step=0)]
    # not merely shifted: most prompts of the next step are new
    step1 = {tuple(p.tokens) for p in _prompts(seed=0, step=1)}
    assert len(step1 - {tuple(t) for t in base}) >= 12


def test_prompt_length_follows_digits():
    (p,) = _prompts(count=1, digits=3)
    assert len(p.tokens) == len("sort 123:") and len(p.answer) == 3


def test_sort_answer_keeps_repeated_digits():
    assert sort_answer("4193") == "1349" and sort_answer("5050") == "0055"


# -- warm-up sequences ------------------------------------------------------------------------
def _sequences(**kw):
    return list(sort_sequences.fn(**{"sequences": 32, **kw}))


def test_sequences_are_prompt_answer_eos_int64_rows_of_one_length():
    seqs = _sequences(digits=4)
    assert len(seqs) == 32
    for seq in seqs:
        assert seq.dtype == torch.int64 and seq.dim() == 1 and len(seq) == 7 + 2 * 4
        text = bytes(seq.tolist()).decode()
        assert text.startswith("sort ") and text.endswith("\n") and text.count("\n") == 1
        prompt, answer = text[:-1].split(":")
        assert answer == sort_answer(prompt[5:])
        assert seq[-1].item() == EOS
    batch = torch.stack(seqs)  # what the pipeline's "lm" loss cuts into inputs and targets
    assert batch.shape == (32, 15) and int(batch.max()) < 128 and int(batch.min()) >= 0


def test_sequences_are_deterministic_per_step_and_differ_across_steps():
    assert all(torch.equal(a, b) for a, b in zip(_sequences(step=2), _sequences(step=2)))
    assert not all(torch.equal(a, b) for a, b in zip(_sequences(step=2), _sequences(step=3)))


def test_sequences_are_drawn_apart_from_the_prompts_of_the_same_step():
    prompts = [bytes(p.tokens).decode() for p in _prompts(count=32, seed=0, step=0)]
    shown = [bytes(s.tolist()).decode().split(":")[0] + ":" for s in _sequences(seed=0, step=0)]
    assert prompts != shown


def test_noisy_sequences_sort_the_wrong_way_as_often_as_asked():
    def ascending_fraction(correct_fraction):
        seqs = list(sort_sequences.fn(sequences=2000, correct_fraction=correct_fraction))
        right = total = 0
        for seq in seqs:
            prompt, answer = bytes(seq.tolist()).decode()[:-1].split(":")
            expected = sort_answer(prompt[5:])
            assert answer in (expected, expected[::-1])
            if expected != expected[::-1]:  # "555" reads the same both ways
                right += answer == expected
                total += 1
        return right / total

    assert ascending_fraction(1.0) == 1.0
    assert 0.17 < ascending_fraction(0.2) < 0.23
    assert ascending_fraction(0.0) == 0.0


def test_sft_targets_mask_the_prompt():
    batch = torch.stack(_sequences(sequences=4, digits=4))
    prompt_len = len("sort 4193:")
    inputs, targets = sft_targets(batch, prompt_len)
    assert torch.equal(inputs, batch[:, :-1])
    assert (targets[:, : prompt_len - 1] == -1).all()
    # the first target kept is the answer's first digit, predicted from the ":"
    assert torch.equal(targets[:, prompt_len - 1:], batch[:, prompt_len:])
    assert (inputs[:, prompt_len - 1] == ord(":")).all()


# -- as ops of a flow -------------------------------------------------------------------------
def test_the_ops_plug_into_rl_and_warm_up_flows_and_are_told_the_step():
    actor = Model(name="actor", build=GPT, stages=1, tags=("train",), config=SORT_GPT)
    with Flow("sort-rl") as rl:
        rollouts = Generate(actor)(sort_prompts(count=4), n=2, max_new_tokens=8)
        sort_reward(rollouts)
    with Flow("sort-sft") as sft:
        stats = Backprop(actor)(sort_sequences(sequences=8), loss="lm", microbatches=2)
        OptimizerStep(actor)(collect(stats), lr=1e-3)
    plans = {plan.name: plan for flow in (rl, sft) for plan in lower_flow(flow)}
    assert plans["sort_prompts"].takes_step and plans["sort_sequences"].takes_step
    assert not plans["sort_reward"].takes_step


def test_prompt_and_a_max_new_tokens_8_response_fit_the_tuned_gpt():
    for digits in (3, 4):
        (p,) = _prompts(count=1, digits=digits)
        assert len(p.tokens) + 8 <= SORT_GPT["block_size"]
        (seq,) = _sequences(sequences=1, digits=digits)
        assert len(seq) - 1 <= SORT_GPT["block_size"]


def test_rollout_metrics_count_and_warn_of_responses_the_context_cut():
    from dataflows.rl.ops import rollout_metrics
    from flowkit.ops.records import Scored

    def scored(sample, clipped):
        return Scored(prompt_id=0, sample=sample, prompt_tokens=[1] * 20,
                      response_tokens=[2] * 12, logprobs=[-1.0] * 12, reward=0.0,
                      finished=False, clipped=clipped)

    metrics = rollout_metrics.fn([scored(0, True), scored(1, False), scored(2, False),
                                  scored(3, True)])
    assert metrics.values["response/clipped_fraction"] == 0.5
    (warning,) = metrics.warnings
    assert "cut by the model's context (32 tokens with the prompt)" in warning
    assert "shorter prompts, a smaller max_new_tokens" in warning
    clean = rollout_metrics.fn([scored(0, False)])
    assert clean.values["response/clipped_fraction"] == 0.0 and clean.warnings == ()
