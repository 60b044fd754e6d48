"""GRPO with an FSDP actor [Note: FSDP within a stage in executors/torch/train/fsdp.py]: two
replicas of its 2-stage pipeline, each stage sharded over them, train the parameters one
replica does, and the rollout executor gets them each step (gathered whole for the export)."""

from __future__ import annotations

import torch

from dataflows.grpo import grpo_flow
from flowkit.planner.lower import lower_flow
from flowkit.runner.flowrun import FlowRunner
from flowkit.runner.setup import with_training_options
from flowkit.runner.training_tasks import model_spec
from tests.torch.test_rl_replicas import STEPS, TINY
from tests.torch.test_rl_replicas import _train as _whole_replicas


def _rollout_weights(pool, replicas: int, fsdp: bool) -> dict:
    """The rollout executor's copy of the actor after the steps."""
    flow = grpo_flow(prompts=4, n=3, stages=2, microbatches=2, max_new_tokens=5,
                     schedule="1f1b", kl_coef=0.01, lr=1e-2, gpt=TINY)
    flow.nodes["update_actor"].config["clip_ratio"] = 10.0  # every token's gradient counts
    flow = with_training_options(flow, stages=None, microbatches=None, schedule=None,
                                 replicas=replicas, fsdp=fsdp)
    tags = [("train",)] * (2 * replicas) + [("rollout",)]
    with pool.shared(len(tags), kind="torch", tags=tags) as (ctl, infos):
        runner = FlowRunner(ctl, lower_flow(flow), steps=STEPS)
        for step in range(STEPS):
            runner.run_step(step)
        rollout = next(e for e in infos if "rollout" in e.tags)
        return ctl.submit("export_weights", config={**model_spec(flow.models["actor"], 1),
                                                    "stage": 0},
                          executor=rollout.id).result(timeout=60)


def test_an_fsdp_actor_trains_and_syncs_what_one_replica_does(pool):
    one, _ = _whole_replicas(pool, 1)
    synced = _rollout_weights(pool, 2, fsdp=True)
    assert synced.keys() == one.keys()
    for name, want in one.items():
        torch.testing.assert_close(synced[name], want, rtol=0, atol=1e-10,
                                   msg=f"{name} differs")
