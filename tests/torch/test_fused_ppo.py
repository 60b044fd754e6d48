"""PPO's actor and critic trained as one fused schedule on torch executor processes give the
parameters of the run that schedules them separately (float64, 1e-10): fusing moves only when
each action runs, never what it computes [Note: fused schedules in flowkit/planner/fused.py]."""

import pytest
import torch

from dataflows.ppo import ppo_flow
from flowkit.planner.lower import lower_flow
from flowkit.runner.flowrun import FlowRunner
from tests.harness import tiny_gpt

TINY = {**tiny_gpt(), "dtype": "float64", "seed": 5}


def _train(pool, tmp_path, *, fuse: bool, schedule: str):
    flow = ppo_flow(prompts=6, stages=2, microbatches=3, max_new_tokens=4, lr=1e-2,
                    critic_lr=1e-2, schedule=schedule, gpt=TINY, fuse_models=fuse)
    flow.nodes["update_actor"].config["clip_ratio"] = 10.0  # every token's gradient counts
    tags = [("train",), ("train",), ("rollout",)]
    with pool.shared(3, kind="torch", tags=tags) as (ctl, _):
        runner = FlowRunner(ctl, lower_flow(flow))
        reports = [runner.run_step(step) for step in range(2)]
        paths = runner.save_weights(tmp_path / ("fused" if fuse else "separate"))
        placement = {name: [e.name for e in executors]
                     for name, executors in runner.placement.items()}
        fused = runner.fusions[0].fused if runner.fusions else None
    weights = {name: torch.load(path, weights_only=True)
               for name, path in zip(runner.training, paths)}
    return weights, reports, placement, fused


@pytest.mark.parametrize("schedule", ["zb-h1"])  # B and W apart: the most to interleave
def test_fused_actor_and_critic_train_the_separate_runs_parameters(pool, tmp_path, schedule):
    fused, reports, placement, plan = _train(pool, tmp_path, fuse=True, schedule=schedule)
    separate, _, _, _ = _train(pool, tmp_path, fuse=False, schedule=schedule)
    assert plan is not None and placement["critic"] == placement["actor"][::-1]
    assert {len({m for m, _ in ops}) for ops in plan.device_ops} == {2}  # both on each device
    assert fused.keys() == separate.keys() == {"actor", "critic"}
    for model in ("actor", "critic"):
        assert fused[model].keys() == separate[model].keys()
        for name in fused[model]:
            torch.testing.assert_close(fused[model][name], separate[model][name], rtol=0,
                                       atol=1e-10, msg=f"{model} {name} differs")
    assert all(r.metrics["update_critic/loss"] > 0 for r in reports)
