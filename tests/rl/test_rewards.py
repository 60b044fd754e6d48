"""Rewards on text (dataflows/rewards.py): plain Python on (prompt, response, answer), read from a
rollout's decoded text or, without one, its byte tokens; `text_reward` makes one from a function
that executors import by name, and a bad config is an error when the flow is validated."""

from __future__ import annotations

import sys

import pytest

from dataflows.rewards import (
    exact_match_reward,
    format_reward,
    last_number,
    math_reward,
    text_reward,
)
from executors.optable import _function_op
from flowkit.dsl import Flow, FlowError, Stream, op
from flowkit.ops.records import Rollout, Scored


def _rollout(response: str, answer: str | None = "42", *, text: bool = True) -> Rollout:
    """A rollout as a tokenizer's model leaves it (text set), or as the byte GPT's (no text)."""
    return Rollout(prompt_id=3, sample=1, prompt_tokens=list(b"Q?"),
                   response_tokens=list(response.encode()), logprobs=[0.0] * len(response),
                   answer=answer, prompt_text="Q?" if text else None,
                   response_text=response if text else None)


@text_reward
def _shouted(prompt: str, response: str, answer: str | None, *, bonus: float = 0.0) -> float:
    return float(response.isupper()) + bonus + (prompt == "Q?")


def test_text_reward_turns_a_function_of_texts_into_a_reward_op():
    assert _shouted.target == f"{__name__}:_shouted", "executors import it by this name"
    assert _shouted.config == {"bonus": 0.0}
    assert str(_shouted.inputs["rollout"].type) == "Stream[Rollout]"  # one call per rollout
    assert str(_shouted.outputs["out"]) == "Stream[Scored]"
    scored = _shouted.fn(_rollout("YES"), bonus=0.5)
    assert isinstance(scored, Scored) and scored.reward == 2.5
    assert scored.response_text == "YES" and scored.prompt_id == 3 and scored.sample == 1
    assert _shouted.fn(_rollout("YES", text=False)).reward == 2.0, "bytes when no text"
    for reward in (_shouted, named, format_reward):  # what an executor runs (executors/optable.py)
        assert _function_op(reward.target) is reward
    with pytest.raises(ValueError, match="name='my_reward'"):
        text_reward(lambda p, r, a: 1.0)


named = text_reward(lambda p, r, a: 1.0, name="named")


def test_exact_match_compares_stripped_text():
    assert exact_match_reward.fn(_rollout(" 42\n")).reward == 1.0
    assert exact_match_reward.fn(_rollout("42.")).reward == 0.0
    assert exact_match_reward.fn(_rollout("42", text=False)).reward == 1.0
    with pytest.raises(ValueError, match="has none"):
        exact_match_reward.fn(_rollout("42", answer=None))


@pytest.mark.parametrize("verifier", ["math_verify", "last number"])
def test_math_reward_checks_the_answer_as_mathematics(verifier, monkeypatch):
    if verifier == "last number":  # math-verify not installed: the numeric fallback
        monkeypatch.setitem(sys.modules, "math_verify", None)
    else:
        pytest.importorskip("math_verify", reason="the hf extra brings math-verify")
    assert math_reward.fn(_rollout("so the answer is \\boxed{42}")).reward == 1.0
    assert math_reward.fn(_rollout("it is 41, or 42.000")).reward == 1.0
    assert math_reward.fn(_rollout("it is 41")).reward == 0.0
    assert math_reward.fn(_rollout("no number here")).reward == 0.0
    half = math_reward.fn(_rollout("$\\frac{1}{2}$", answer="0.5")).reward
    assert half == (1.0 if verifier == "math_verify" else 0.0), "only math-verify reads LaTeX"
    assert last_number("from 3 to 1,250.5 apples") == 1250.5 and last_number("none") is None


def test_format_reward_searches_its_pattern_and_checks_it_when_validated():
    assert format_reward.fn(_rollout("thus \\boxed{42}.")).reward == 1.0
    assert format_reward.fn(_rollout("42")).reward == 0.0
    assert format_reward.fn(_rollout("<a>x</a>"), pattern=r"^<a>.*</a>$").reward == 1.0

    @op
    def rollouts(*, count: int = 1) -> Stream[Rollout]:
        yield _rollout("x")

    with pytest.raises(FlowError, match="not a regular expression"), Flow("fmt"):
        format_reward(rollouts(), pattern="(unclosed")
