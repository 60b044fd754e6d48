"""A GRPO step end to end on torch executor processes: generation on a rollout executor, the
actor trained in two pipeline stages on two others, its weights synced back each step; fused
(microbatches forming from finished groups) and stage by stage give the same parameters, with
GRPO's loss and with the DAPO and Dr. GRPO recipes'."""

import pytest
import torch

from dataflows.grpo import grpo_flow
from dataflows.recipes import dapo_flow, dr_grpo_flow
from flowkit.planner.lower import lower_flow
from flowkit.runner.flowrun import FlowRunner
from flowkit.runner.training_tasks import model_spec
from tests.harness import seeded_gpt, tiny_gpt
from tests.torch.rl_ops import staged_reward

GPT_CONFIG = tiny_gpt()
TINY = {**GPT_CONFIG, "dtype": "float64", "seed": 3}
STEPS = {"grpo": 2, "dapo": 3, "dr_grpo": 2}


SETTINGS = dict(prompts=4, n=3, stages=2, microbatches=2, max_new_tokens=5, lr=1e-2, gpt=TINY)
# GRPO, and two recipes whose losses normalize otherwise: DAPO's token-level loss with the
# entropy bonus, a geometric-mean rollout correction and cut responses masked, under ZB-H1,
# its dynamic sampling dropping every group in step 0 (nothing trains) and half of them after
# (staged_reward); Dr. GRPO's per-response sums over the budget (a normalizer of responses)
FLOWS = {
    "grpo": lambda: grpo_flow(schedule="1f1b", kl_coef=0.01, **SETTINGS),
    "dapo": lambda: dapo_flow(schedule="zb-h1", entropy_coeff=0.01, rollout_is="geometric",
                              reward=staged_reward, **SETTINGS),
    "dr_grpo": lambda: dr_grpo_flow(schedule="zb-h1", **SETTINGS),
}


def _flow(name: str):
    # a large clip range keeps every token's gradient, so the update is far from zero
    flow = FLOWS[name]()
    flow.nodes["update_actor"].config["clip_ratio"] = 10.0
    return flow


def _train(pool, tmp_path, name: str, *, fuse: bool):
    tags = [("train",), ("train",), ("rollout",)]
    with pool.shared(3, kind="torch", tags=tags) as (ctl, infos):
        flow = _flow(name)
        runner = FlowRunner(ctl, lower_flow(flow), fuse=fuse)
        reports = [runner.run_step(step) for step in range(STEPS[name])]
        (path,) = runner.save_weights(tmp_path / ("fused" if fuse else "barrier"))
        rollout = next(e for e in infos if "rollout" in e.tags)
        whole = ctl.submit("export_weights", config={**model_spec(flow.models["actor"], 1),
                                                      "stage": 0},
                           executor=rollout.id).result(timeout=60)
        streamed = runner.states["update_actor"].pipeline.streamed
    return torch.load(path, weights_only=True), whole, reports, streamed


@pytest.fixture(scope="module", params=list(FLOWS))
def runs(request, tmp_path_factory, pool):
    tmp = tmp_path_factory.mktemp(request.param)
    return {fuse: _train(pool, tmp, request.param, fuse=fuse) for fuse in (True, False)}


def test_fused_and_stage_by_stage_train_the_same_parameters(runs):
    fused, _, _, streamed = runs[True]
    barrier, _, _, not_streamed = runs[False]
    assert streamed and not not_streamed  # the last step's microbatches formed as items came
    assert fused.keys() == barrier.keys()
    for name in fused:
        torch.testing.assert_close(fused[name], barrier[name], rtol=0, atol=1e-10,
                                   msg=f"{name} differs")


def test_the_generator_holds_the_trained_weights_after_each_step(runs):
    trained, generator, reports, _ = runs[True]
    model = seeded_gpt(GPT_CONFIG, seed=TINY["seed"], dtype=torch.float64)
    initial = dict(model.state_dict())
    moved = [name for name in trained if not torch.equal(trained[name], initial[name])]
    assert moved, "training changed no weight"
    for name, tensor in trained.items():
        torch.testing.assert_close(generator[name], tensor, rtol=0, atol=0)
    assert all("reward_mean" in r.metrics for r in reports)
    taken = [r.metrics.get("grpo_advantages/groups_taken") for r in reports]
    if taken[0] is not None:  # DAPO: 8 groups a round, none differs in step 0, 4 after
        assert taken == [0, 4, 4]
        # step 0 runs all 3 rounds in vain; then the first round has the 4 groups
        assert [r.metrics["grpo_advantages/groups_empty"] for r in reports] == [24, 4, 4]
        assert [r.metrics["generate/sampling_rounds"] for r in reports] == [3, 1, 1]
        assert [r.metrics["update_actor/tokens"] > 0 for r in reports] == [False, True, True]
