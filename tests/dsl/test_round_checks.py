"""A Backprop's minibatch rounds (epochs, minibatches) are checked when the flow is validated,
before anything runs: whole counts >= 1, an OptimizerStep to configure the rounds' steps, and
no second Backprop of the model [Note: minibatch rounds in flowkit/ops/minibatches.py]."""

from __future__ import annotations

import pytest

from dataflows.model_ops import Backprop, OptimizerStep
from dataflows.ppo import ppo_flow
from flowkit.dsl import Flow, FlowError, Stream, collect, op


@op
def items(*, count: int = 4) -> Stream[int]:
    yield from range(count)


def _problems(build) -> list:
    with pytest.raises(FlowError) as raised:
        with Flow("rounds"):
            build()
    return raised.value.problems


@pytest.mark.parametrize("key, value", [("epochs", 0), ("minibatches", -2), ("epochs", 1.5),
                                        ("minibatches", True), ("microbatches", 0)])
def test_a_count_below_one_or_not_whole_is_named_with_its_meaning(actor, key, value):
    def build():
        stats = Backprop(actor)(items(), **{key: value})
        OptimizerStep(actor)(collect(stats))

    (problem,) = _problems(build)
    assert (problem.rule, problem.op, problem.port) == ("bad-count", "backprop", key)
    assert f"{key}={value!r} is not a whole number >= 1" in problem.message
    assert f"{key}=" in problem.fix


def test_rounds_need_an_optimizer_step_fed_by_their_stats(actor):
    (problem,) = _problems(lambda: Backprop(actor)(items(), epochs=2, minibatches=2))
    assert problem.rule == "rounds-without-step"
    assert "epochs=2, minibatches=2 take an optimizer step after each minibatch" in problem.message
    assert "OptimizerStep('actor')(collect(backprop.stats))" in problem.fix


def test_rounds_cannot_share_the_models_step_with_another_backprop(actor):
    def build():
        batch = items()
        first = Backprop(actor)(batch, minibatches=2, name="first")
        second = Backprop(actor)(batch, name="second")
        OptimizerStep(actor)(collect(first))
        OptimizerStep(actor)(collect(second), name="step2")

    (problem,) = _problems(build)
    assert (problem.rule, problem.op) == ("rounds-shared-step", "first")
    assert "also trained by 'second'" in problem.message


def test_config_changed_after_the_build_is_checked_at_validation():
    flow = ppo_flow(ppo_epochs=2, minibatches=4)
    assert flow.check() == []
    assert flow.nodes["update_critic"].config["epochs"] == 2
    flow.nodes["update_actor"].config["minibatches"] = 0
    assert [p.rule for p in flow.check()] == ["bad-count"]
