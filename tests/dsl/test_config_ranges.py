"""Numeric settings of the model ops are checked when the flow is built, not on the executors."""

from __future__ import annotations

import pytest

from dataflows.model_ops import Backprop, Generate, OptimizerStep
from dataflows.rl.ops import arithmetic_prompts
from flowkit.dsl import Flow, FlowError, Model, collect

ACTOR = Model(name="actor", build="m:M")


def _problems(**generate) -> list:
    with pytest.raises(FlowError) as raised:
        with Flow("f"):
            Generate(ACTOR)(arithmetic_prompts(), **generate)
    return raised.value.problems


@pytest.mark.parametrize(("key", "value", "allowed"), [
    ("n", 0, ">= 1"), ("max_new_tokens", -3, ">= 1"), ("temperature", -0.5, ">= 0"),
    ("top_p", 1.5, ">= 0 and <= 1")])
def test_a_setting_out_of_range_is_a_problem_saying_what_is_allowed(key, value, allowed):
    (problem,) = _problems(**{key: value})
    assert (problem.rule, problem.op, problem.port) == ("bad-config", "generate", key)
    assert problem.message == f"{key}={value!r} is out of range: it must be {allowed}"
    assert problem.fix == f"pass {key} {allowed}"


def test_a_setting_that_is_not_a_number_says_so():
    (problem,) = _problems(n="4")
    assert problem.message == "n='4' must be a number (>= 1)"


def test_every_mistake_of_a_call_is_reported_together():
    assert [p.port for p in _problems(n=0, max_new_tokens=0)] == ["n", "max_new_tokens"]


def test_settings_in_range_and_unset_ones_pass():
    with Flow("f"):
        stats = Backprop(ACTOR)(arithmetic_prompts(), microbatches=1, kl_coef=0.0,
                                memory_limit=None)
        OptimizerStep(ACTOR)(collect(stats), lr=1e-3, clip_grad_norm=None)
        Generate(ACTOR)(arithmetic_prompts(name="more"), n=1, temperature=0, top_p=1)


def test_training_settings_are_checked_too():
    with pytest.raises(FlowError) as raised:
        with Flow("f"):
            stats = Backprop(ACTOR)(arithmetic_prompts(), microbatches=0, clip_ratio_c=0.5)
            OptimizerStep(ACTOR)(collect(stats), lr=-1)
    assert [(p.rule, p.op, p.port) for p in raised.value.problems] == [
        ("bad-config", "backprop", "clip_ratio_c"), ("bad-config", "optimizer_step", "lr"),
        ("bad-count", "backprop", "microbatches")]  # a count: Backprop.node_problems


@pytest.mark.parametrize(("config", "message"), [
    ({"behav_cap": 0.5}, "behav_cap=0.5 is out of range: it must be >= 1"),
    ({"decoupled": "false"}, "decoupled='false' is not True or False"),
    ({"decoupled": 1}, "decoupled=1 is not True or False")])
def test_the_decoupled_objectives_settings_are_checked(config, message):
    with pytest.raises(FlowError) as raised:
        with Flow("f"):
            Backprop(ACTOR)(arithmetic_prompts(), loss="ppo", **config)
    (problem,) = raised.value.problems
    assert (problem.rule, problem.op, problem.message) == ("bad-config", "backprop", message)


def test_the_decoupled_objective_in_range_passes():
    with Flow("f"):
        Backprop(ACTOR)(arithmetic_prompts(), loss="ppo", decoupled=True, behav_cap=1)
