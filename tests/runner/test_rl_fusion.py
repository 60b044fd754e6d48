"""Sample-level fusion of an RL step on simulator executors: a GRPO step's training starts
before its last sample is generated once the batch size is known; with barriers it never does."""

import pytest

from dataflows.grpo import grpo_flow
from flowkit.planner.lower import lower_flow
from flowkit.planner.simcosts import SimCosts
from flowkit.runner.flowrun import FlowRunner

COSTS = SimCosts(F=0.004, B=0.004, W=0.002, token=0.001, length_sigma=1.0)


@pytest.fixture(scope="module")
def cluster(pool):
    tags = [("rollout",)] * 2 + [("train",)] * 2
    with pool.shared(4, kind="sim", tags=tags) as (ctl, _):
        yield ctl


def _run(ctl, *, fuse: bool, steps: int = 2):
    # every sample decodes at once on the rollout engines: a long tail (up to 512 tokens of a
    # median 64; at 1 ms a token, half a second) during which most groups are done, so training
    # can start (0.4 ms a token left too little room on a loaded machine)
    flow = grpo_flow(prompts=12, n=2, stages=2, microbatches=6, max_new_tokens=512,
                     schedule="1f1b")
    runner = FlowRunner(ctl, lower_flow(flow), sim_costs=COSTS, fuse=fuse)
    return runner, [runner.run_step(step) for step in range(steps)]


def _starts_and_ends(runner):
    states = runner.states
    return (states["update_actor"].first_start, states["generate"].last_end,
            states["grpo_advantages"].last_end)


def test_fused_training_starts_while_generation_runs_after_the_first_step(cluster):
    runner, reports = _run(cluster, fuse=True)
    train_start, gen_end, _ = _starts_and_ends(runner)
    assert train_start < gen_end  # step 1: microbatches formed from finished groups
    feeding = runner.states["update_actor"].pipeline
    assert feeding.streamed and len(feeding.taken) == 24 == sum(feeding.sizes)
    assert reports[-1].metrics["reward_mean"] >= 0.0
    assert reports[-1].metrics["response_length_mean"] > 0


def test_the_first_step_and_unfused_steps_wait_for_every_sample(cluster):
    runner, _ = _run(cluster, fuse=True, steps=1)
    train_start, _, last_advantage = _starts_and_ends(runner)
    assert train_start >= last_advantage  # step 0 learns the batch size: a barrier
    runner, _ = _run(cluster, fuse=False)
    train_start, _, last_advantage = _starts_and_ends(runner)
    assert train_start >= last_advantage
    assert not runner.states["update_actor"].pipeline.streamed
