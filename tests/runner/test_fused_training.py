"""Fused training on simulator executors [Note: fused training in flowkit/runner/fusedtrain.py]:
PPO's actor and critic run one fused schedule, each executor in the planned order, the critic's
stages on the actor's executors the other way round, within the memory limit; and what fusing
cannot run is refused before anything starts. tests/torch/test_fused_ppo.py holds the
parameters to the separate run's."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from dataflows.model_ops import Backprop, OptimizerStep
from dataflows.ppo import ppo_flow
from dataflows.rl.front import rl_actor
from flowkit.dsl import Flow, FlowError, Model, collect
from flowkit.planner.lower import lower_flow
from flowkit.planner.simcosts import SimCosts
from flowkit.runner.flowrun import FlowRunError, FlowRunner
from tests.runner import flowdefs

SIM = SimCosts(F=0.002, B=0.002, W=0.002)


@pytest.fixture(scope="module")
def sim_cluster(pool):
    code = [str(Path(flowdefs.__file__))]
    with pool.shared(4, kind="sim", tags=("train", "rollout"), code=code) as (ctl, _):
        yield ctl


def _ppo(*, fuse: bool, limit: float | None = None):
    flow = ppo_flow(prompts=8, microbatches=4, stages=4, schedule="1f1b", fuse_models=fuse)
    for node in ("update_actor", "update_critic"):
        flow.nodes[node].config.update(offload="none", memory_limit=limit)  # report memory
    return flow


def _ran_order(runner: FlowRunner) -> dict[int, list[tuple[int, str]]]:
    """Each executor's pipeline actions of both models, in the order they started."""
    ran: dict[int, list] = {}
    for index, node in enumerate(("update_actor", "update_critic")):
        for action, future in runner.states[node].pipeline.runs[0].futures.items():
            ran.setdefault(future.location, []).append((future.timing[0], index, str(action)))
    return {executor: [(m, a) for _, m, a in sorted(ops)] for executor, ops in ran.items()}


def test_each_executor_runs_the_fused_order_and_the_critic_runs_the_other_way(sim_cluster):
    runner = FlowRunner(sim_cluster, lower_flow(_ppo(fuse=True)), sim_costs=SIM)
    reports = [runner.run_step(step) for step in range(2)]
    actor, critic = runner.placement["actor"], runner.placement["critic"]
    assert [e.id for e in critic] == [e.id for e in reversed(actor)]
    (fusion,) = runner.fusions
    planned = {executor.id: [(m, str(a)) for m, a in fusion.fused.device_ops[shared]]
               for shared, executor in enumerate(actor)}
    assert _ran_order(runner) == planned
    report = reports[-1].metrics
    assert report["predicted_bubble_rate"] == fusion.predicted["bubble_rate"]
    assert fusion.predicted["makespan"] < fusion.predicted["separate_makespan"]
    assert 0 < report["pipeline_makespan_s"] and 0 <= report["bubble_rate"] < 1
    assert report["update_critic/loss"] == report["update_critic/loss"]  # trained: not NaN


def test_a_memory_limit_bounds_what_each_executor_holds_of_both_models(sim_cluster):
    """Alone, 1F1B on 4 stages holds 4 microbatches on the first device; two pipelines
    interleaved by the executors as their ops come hold more; fused under a limit of 4, no
    executor holds more than 4 of both models' together."""
    limited = FlowRunner(sim_cluster, lower_flow(_ppo(fuse=True, limit=4.0)), sim_costs=SIM)
    free = FlowRunner(sim_cluster, lower_flow(_ppo(fuse=False)), sim_costs=SIM)
    peaks = {}
    for name, runner in (("limited", limited), ("free", free)):
        for step in range(2):
            metrics = runner.run_step(step).metrics
        # the simulator counts an executor's stashes whichever model made them
        peaks[name] = max(metrics["actor/peak_activation_microbatches"],
                          metrics["critic/peak_activation_microbatches"])
    assert peaks["limited"] <= 4.0 < peaks["free"]


def test_a_fused_model_in_replicas_is_refused_before_anything_starts(sim_cluster):
    actor = attrs.evolve(rl_actor(None, gpt=None, stages=2), replicas=2)
    flow = ppo_flow(prompts=8, microbatches=4, model=actor, fuse_models=True)
    with pytest.raises(FlowRunError, match="model 'actor' trains as 2 replicas and its "
                                           "backprop is fused"):
        FlowRunner(sim_cluster, lower_flow(flow), sim_costs=SIM)


def test_a_fuse_group_is_checked_with_the_flow():
    one = Model(name="one", build="pkg.models:build", stages=2, tags=("train",))
    with pytest.raises(FlowError) as raised:
        with Flow("alone"):
            OptimizerStep(one)(collect(Backprop(one)(flowdefs.samples(count=4), fuse="g")))
    (problem,) = raised.value.problems
    assert (problem.rule, problem.port) == ("fuse-alone", "fuse")
    assert "no backprop of another model names that group" in problem.message
    with pytest.raises(FlowError) as raised:
        ppo_flow(fuse_models=True, ppo_epochs=2)
    rules = {p.rule for p in raised.value.problems}
    assert rules == {"fuse-rounds"}
    two = Model(name="two", build="pkg.models:build", stages=2, tags=("train",))
    with pytest.raises(FlowError) as raised:  # the second waits for the first's plan: refused
        with Flow("chained"):
            first = Backprop(one)(flowdefs.samples(count=4), fuse="g", name="first")
            OptimizerStep(one)(collect(first), name="step1")
            OptimizerStep(two)(collect(Backprop(two)(first, fuse="g", name="second")),
                               name="step2")
    (problem,) = raised.value.problems
    assert (problem.rule, problem.op) == ("fuse-dependent", "second")
    assert "it reads what 'first', in the same group, makes" in problem.message


def test_a_fused_model_with_more_stages_than_the_first_is_refused(sim_cluster):
    flow = ppo_flow(prompts=8, microbatches=4, stages=2, fuse_models=True,
                    critic=Model(name="critic", build="pkg.models:build", stages=4,
                                 tags=("train",)))
    with pytest.raises(FlowRunError, match="model 'critic' trains fused in 4 stages on the "
                                           "executors of the group's first model, which has "
                                           "2: give it at most 2 stages"):
        FlowRunner(sim_cluster, lower_flow(flow), sim_costs=SIM)
