"""GRPO with a data-parallel actor: two replicas of its 2-stage pipeline (4 train executors)
train the parameters one replica does on the same samples, to 1e-10 in float64; the rollout
executor gets replica 0's weights each step; asynchronously with η = 0 the same again."""

from __future__ import annotations

import pytest
import torch

from dataflows.grpo import grpo_flow
from flowkit.planner.lower import lower_flow
from flowkit.runner.flowrun import FlowRunner
from flowkit.runner.setup import with_training_options
from flowkit.runner.training_tasks import model_spec
from tests.harness import tiny_gpt

TINY = {**tiny_gpt(), "dtype": "float64", "seed": 3}
STEPS = 2


def _train(pool, replicas: int, *, staleness: int | None = None) -> tuple[dict, dict]:
    """The actor's saved weights after the steps, and the rollout executor's copy."""
    flow = grpo_flow(prompts=4, n=3, stages=2, microbatches=2, max_new_tokens=5,
                     schedule="1f1b", kl_coef=0.01, lr=1e-2, gpt=TINY)
    flow.nodes["update_actor"].config["clip_ratio"] = 10.0  # every token's gradient counts
    flow = with_training_options(flow, stages=None, microbatches=None, schedule=None,
                                 replicas=replicas)
    tags = [("train",)] * (2 * replicas) + [("rollout",)]
    with pool.shared(len(tags), kind="torch", tags=tags) as (ctl, infos):
        runner = FlowRunner(ctl, lower_flow(flow), staleness=staleness, steps=STEPS)
        for step in range(STEPS):
            runner.run_step(step)
        rollout = next(e for e in infos if "rollout" in e.tags)
        generator = ctl.submit("export_weights", config={**model_spec(flow.models["actor"], 1),
                                                          "stage": 0},
                               executor=rollout.id).result(timeout=60)
        schedule, spec = runner.trained["actor"]
        training = runner.training["actor"]
        replicas_weights = []
        for replica in range(replicas):
            weights = {}
            for stage in range(schedule.num_stages):
                device = schedule.placement.device_of(stage)
                weights.update(ctl.submit("export_weights", config={**spec, "stage": stage},
                                          executor=training.replica(replica)[device].id
                                          ).result(timeout=60))
            replicas_weights.append(weights)
    for other in replicas_weights[1:]:
        _assert_equal(other, replicas_weights[0], "replica 1 against replica 0")
    return replicas_weights[0], generator


def _assert_equal(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-10,
                                   msg=f"{where}: {name} differs")


@pytest.fixture(scope="module")
def one_replica(pool):
    return _train(pool, 1)


def test_two_replicas_train_what_one_does(pool, one_replica):
    trained, generator = _train(pool, 2)
    _assert_equal(trained, one_replica[0], "2 replicas against 1")
    _assert_equal(generator, trained, "the rollout executor's weights")


def test_asynchronous_with_no_staleness_equals_synchronous(pool, one_replica):
    trained, _ = _train(pool, 2, staleness=0)
    _assert_equal(trained, one_replica[0], "async eta=0 with 2 replicas against sync")
