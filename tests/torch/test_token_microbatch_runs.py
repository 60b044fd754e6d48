"""Token-budget microbatches end to end on torch executor processes [Note: token-budget
microbatches in flowkit/runner/token_microbatches.py]: GRPO with `microbatch_tokens` trains the
parameters of the same run cut by count, a barrier step and streamed ones, on one pipeline and
on two replicas (with packed rows too), and PPO's fused actor and critic, in float64 (their
losses are in sum form, so any cut is the whole batch's)."""

import pytest
import torch

from dataflows.grpo import grpo_flow
from dataflows.ppo import ppo_flow
from flowkit.planner.lower import lower_flow
from flowkit.runner.flowrun import FlowRunner
from flowkit.runner.setup import with_training_options
from tests.harness import tiny_gpt
from tests.torch.helpers import assert_same_training
from tests.torch.rl_ops import even_token_reward

TINY = {**tiny_gpt(), "dtype": "float64", "seed": 3}
STOPS = list(range(0, 64, 6))  # responses stop early or run on: lengths differ
LAYOUTS = {"pipeline": dict(stages=2, replicas=1), "replicas": dict(stages=1, replicas=2)}
SETTINGS = dict(prompts=4, n=3, max_new_tokens=12, lr=1e-2, gpt=TINY, reward=even_token_reward,
                schedule="1f1b")
FLOWS = {"grpo": lambda: grpo_flow(kl_coef=0.05, **SETTINGS),
         "ppo": lambda: ppo_flow(**SETTINGS)}  # the actor's and the critic's pipelines fused


def _train(pool, tmp_path, name: str, layout: str, packing: bool = False,
           **cut) -> tuple[dict, list, object]:
    tags = [("train",), ("train",), ("rollout",)]
    with pool.shared(3, kind="torch", tags=tags) as (ctl, _):
        flow = FLOWS[name]()
        for node in flow.nodes.values():
            if "eos" in node.config:
                node.config["eos"] = STOPS
        flow = with_training_options(flow, schedule=None, packing=packing, **LAYOUTS[layout],
                                     **cut)
        runner = FlowRunner(ctl, lower_flow(flow))
        reports = [runner.run_step(step) for step in range(3)]
        feeding = runner.states["update_actor"].pipeline
        paths = runner.save_weights(tmp_path)
    return {p.name: torch.load(p, weights_only=True) for p in paths}, reports, feeding


@pytest.mark.parametrize("name, layout, packing", [
    ("grpo", "pipeline", False), ("grpo", "replicas", False), ("ppo", "pipeline", False),
    ("grpo", "replicas", True),  # packed rows in token-budget microbatches
])
def test_token_budget_microbatches_train_the_parameters_of_count_based_ones(pool, tmp_path,
                                                                            name, layout,
                                                                            packing):
    counted, counted_reports, _ = _train(pool, tmp_path / "count", name, layout,
                                         microbatches=2, microbatch_tokens=None)
    tokened, reports, feeding = _train(pool, tmp_path / "tokens", name, layout, packing,
                                       microbatches=None, microbatch_tokens=40)
    # the last step formed its microbatches by tokens as the items came, more than by count
    assert feeding.streamed and feeding.budget == 40 and len(feeding.sizes) > 2
    assert feeding.slots.left == 0 and len(feeding.taken) == 12
    assert_same_training(counted, tokened, counted_reports, reports)
