"""Packed rows end to end on torch executor processes [Note: packed rows in
executors/torch/models/packing.py]: GRPO (the reference's log-probs scored packed) and PPO (the
critic's values scored packed, its value loss trained packed) train the parameters of the same
runs on padded rows, in float64, GRPO on two replicas too; `--packing` reaches every model of a
run."""

import attrs
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
SETTINGS = dict(prompts=4, n=3, stages=2, microbatches=2, max_new_tokens=12, lr=1e-2, gpt=TINY,
                reward=even_token_reward)
STOPS = list(range(0, 64, 6))  # responses stop early or run on: lengths that pack
FLOWS = {"grpo": lambda: grpo_flow(schedule="zb-h1", kl_coef=0.05, **SETTINGS),
         "ppo": lambda: ppo_flow(schedule="1f1b", **SETTINGS),
         # two replicas of one stage: the packed microbatches' gradients all-reduced
         "grpo-replicas": lambda: with_training_options(
             grpo_flow(schedule="1f1b", kl_coef=0.05, **{**SETTINGS, "stages": 1}),
             stages=None, microbatches=None, schedule=None, replicas=2)}


def _train(pool, tmp_path, name: str, *, packing: bool) -> tuple[dict, list]:
    tags = [("train",), ("train",), ("rollout",)]
    with pool.shared(3, kind="torch", tags=tags) as (ctl, _):
        flow = FLOWS[name]()
        for node in flow.nodes.values():
            if "eos" in node.config:
                node.config["eos"] = STOPS
        if packing:
            for key, model in flow.models.items():
                flow.models[key] = attrs.evolve(model, packing=True)
        runner = FlowRunner(ctl, lower_flow(flow))
        reports = [runner.run_step(step) for step in range(2)]
        assert 0 < reports[0].metrics["finished_fraction"] < 1  # lengths differ
        paths = runner.save_weights(tmp_path / ("packed" if packing else "padded"))
    return {p.name: torch.load(p, weights_only=True) for p in paths}, reports


@pytest.mark.parametrize("name", list(FLOWS))
def test_packed_runs_train_the_parameters_of_padded_ones(pool, tmp_path, name):
    padded, padded_reports = _train(pool, tmp_path, name, packing=False)
    packed, packed_reports = _train(pool, tmp_path, name, packing=True)
    assert_same_training(padded, packed, padded_reports, packed_reports)
    assert all(report.metrics["reward_mean"] > 0 for report in padded_reports)


def test_the_packing_option_reaches_every_model():
    flow = with_training_options(FLOWS["ppo"](), stages=None, microbatches=None,
                                 schedule=None, packing=True)
    assert flow.models and all(model.packing for model in flow.models.values())
