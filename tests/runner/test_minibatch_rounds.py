"""Minibatch rounds [Note: minibatch rounds in flowkit/ops/minibatches.py]: the shuffle and the
cuts as pure functions, then PPO with several epochs on simulator executors, and the one error
that only the run can find (fewer items than minibatches). tests/torch/test_ppo_epochs.py holds
the numbers to a plain loop."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataflows.model_ops import Backprop, OptimizerStep
from dataflows.ppo import ppo_flow
from flowkit.dsl import Flow, Model, collect
from flowkit.ops import cut, epoch_order, minibatch_rounds
from flowkit.planner.lower import lower_flow
from flowkit.planner.simcosts import SimCosts
from flowkit.runner.flowrun import FlowRunError, FlowRunner
from tests.runner import flowdefs

SIM = SimCosts(F=0.001, B=0.001, W=0.0005)


# -- the cuts ---------------------------------------------------------------------------------
@settings(max_examples=50, deadline=None)
@given(data=st.data(), count=st.integers(1, 40), epochs=st.integers(1, 3))
def test_each_epoch_cuts_the_whole_batch_into_near_equal_minibatches(data, count, epochs):
    minibatches = data.draw(st.integers(1, count))
    rounds = minibatch_rounds(count, epochs=epochs, minibatches=minibatches, seed=3, step=5)
    assert len(rounds) == epochs * minibatches
    for epoch in range(epochs):
        parts = rounds[epoch * minibatches:(epoch + 1) * minibatches]
        assert sorted(i for part in parts for i in part) == list(range(count))
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_the_shuffle_is_seeded_by_seed_step_and_epoch_and_one_round_keeps_the_order():
    order = epoch_order(20, seed=0, step=1, epoch=0)
    assert order == epoch_order(20, seed=0, step=1, epoch=0) != list(range(20))
    others = [epoch_order(20, seed=1, step=1, epoch=0), epoch_order(20, seed=0, step=2, epoch=0),
              epoch_order(20, seed=0, step=1, epoch=1)]
    assert all(other != order for other in others)
    assert minibatch_rounds(5, epochs=1, minibatches=1, seed=0, step=0) == [[0, 1, 2, 3, 4]]
    assert cut(list("abcdefg"), 3) == [["a", "b", "c"], ["d", "e"], ["f", "g"]]


def test_more_minibatches_than_items_is_an_error_naming_both():
    with pytest.raises(ValueError, match="minibatches=4 needs at least 4 items .* got 3"):
        minibatch_rounds(3, epochs=2, minibatches=4, seed=0, step=0)


# -- on simulator executors -------------------------------------------------------------------
@pytest.fixture(scope="module")
def sim_cluster(pool):
    code = [str(Path(flowdefs.__file__))]
    with pool.shared(2, kind="sim", tags=("train", "rollout"), code=code) as (ctl, _):
        yield ctl


def test_ppo_with_two_epochs_runs_on_the_simulator(sim_cluster):
    flow = ppo_flow(prompts=12, microbatches=2, ppo_epochs=2, minibatches=3)
    runner = FlowRunner(sim_cluster, lower_flow(flow), sim_costs=SIM)
    reports = [runner.run_step(step) for step in range(2)]  # the second reads the first's weights
    for report in reports:
        for node in ("update_actor", "update_critic"):
            assert report.metrics[f"{node}/optimizer_steps"] == 6
        assert 0 <= report.metrics["bubble_rate"] < 1
    (metrics,) = runner.previous[("actor_step", "metrics")].ordered()
    metrics = metrics.result(timeout=10)
    assert metrics.step == 1 and metrics.optimizer_steps == 6
    # the report sums the rounds' tokens, as the runner's metric does: a token per epoch
    assert metrics.tokens == reports[-1].metrics["update_actor/tokens"] > 0
    assert runner.states["update_actor"].pipeline.streamed is False  # rounds: a barrier


def test_fewer_items_than_minibatches_fails_the_step_in_one_line(sim_cluster):
    model = Model(name="few", build="pkg.models:build", stages=2, tags=("train",))
    with Flow("few") as flow:
        stats = Backprop(model)(flowdefs.samples(count=3), epochs=2, minibatches=4)
        OptimizerStep(model)(collect(stats))
    runner = FlowRunner(sim_cluster, lower_flow(flow), sim_costs=SIM)
    with pytest.raises(FlowRunError) as raised:
        runner.run_step(0)
    assert str(raised.value) == ("step 0: 'backprop': minibatches=4 needs at least 4 items in "
                                 "the batch, got 3")
