"""A group_by of a fan-out (n samples per prompt) is checked against n when the flow is built."""

from __future__ import annotations

import pytest

from dataflows.model_ops import Generate, LogProbs
from dataflows.rl.ops import answer_reward, arithmetic_prompts, grpo_advantages, with_reference
from flowkit.dsl import Flow, FlowError, Grouped, Model, Stream, group_by, op
from flowkit.ops.records import Experience, Rollout

ACTOR = Model(name="actor", build="m:M")


def _grpo(n: int, size: int | None, *, through_reference: bool = True) -> Flow:
    with Flow("grpo") as flow:
        rollouts = Generate(ACTOR)(arithmetic_prompts(), n=n)
        scored = answer_reward(rollouts)
        if through_reference:  # a join of two per-sample streams passes the count through
            scored = with_reference(scored, LogProbs(ACTOR)(rollouts))
        grpo_advantages(group_by(scored, key="prompt_id", size=size))
    return flow


@pytest.mark.parametrize("size", [8, 3])
def test_a_group_size_that_n_cannot_fill_is_a_problem_naming_both(size):
    with pytest.raises(FlowError) as raised:
        _grpo(n=4, size=size)
    (problem,) = raised.value.problems
    assert (problem.rule, problem.op, problem.port) == ("group-size", "grpo_advantages", "group")
    assert f"size={size}" in problem.message and "'generate'" in problem.message
    assert "n=4" in problem.message and "flushed when the step ends" in problem.message
    assert problem.fix == f"set group_by(..., size=4), or n={size} on 'generate'"


@pytest.mark.parametrize(("n", "size"), [(4, 4), (8, 4), (4, None)])
def test_whole_groups_or_an_unsized_group_by_pass(n, size):
    _grpo(n=n, size=size, through_reference=False)
    _grpo(n=n, size=size)


@op
def fan_out(rollout: Rollout) -> Stream[Rollout]:
    yield rollout


@op
def per_group(group: Grouped[Rollout]) -> Stream[Experience]:
    yield from ()


def test_an_op_that_yields_many_breaks_the_chain_so_nothing_is_claimed():
    with Flow("f"):
        rollouts = Generate(ACTOR)(arithmetic_prompts(), n=4)
        per_group(group_by(fan_out(rollouts), key="prompt_id", size=8))


def test_a_group_by_on_another_key_is_not_checked_against_n():
    with Flow("f"):
        rollouts = Generate(ACTOR)(arithmetic_prompts(), n=4)
        per_group(group_by(rollouts, key="sample", size=8))
