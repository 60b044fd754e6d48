"""The ready-made flows take any Model, and derive their other roles from it."""

from __future__ import annotations

import attrs
import pytest

from dataflows.grpo import grpo_flow
from dataflows.models import GPT_BUILD
from dataflows.ppo import ppo_flow
from dataflows.pretrain import pretrain_flow
from dataflows.reinforce_pp import reinforce_pp_flow
from dataflows.rloo import rloo_flow
from flowkit.dsl import Model

OWN = Model(name="policy", build="tinylm:TinyLM", config={"width": 16}, stages=2,
            tags=("cpu",))


def _model_of(flow, node_name):
    return flow.nodes[node_name].model  # the name of the Model it runs on


def test_grpo_runs_every_model_op_on_the_given_model_and_a_frozen_copy():
    flow = grpo_flow(model=OWN).validate()
    assert flow.models["policy"] == OWN
    reference = flow.models["reference"]
    assert (reference.build, dict(reference.config), reference.stages) == (
        "tinylm:TinyLM", {"width": 16}, 1)
    assert {_model_of(flow, n) for n in ("generate", "update_actor")} == {"policy"}
    assert _model_of(flow, "ref_logprobs") == "reference"


def test_ppo_critic_is_the_actor_build_with_a_value_head_unless_given():
    flow = ppo_flow(model=attrs.evolve(OWN, config={"width": 16, "checkpoint": "a.pt"}))
    critic = flow.validate().models["critic"]
    assert critic.build == "tinylm:TinyLM" and critic.stages == 2
    assert dict(critic.config) == {"width": 16, "value_head": True}  # fresh weights
    mine = Model(name="judge", build="tinylm:TinyCritic")
    assert ppo_flow(model=OWN, critic=mine).validate().models["judge"] == mine


def test_stages_recuts_the_given_model():
    flow = pretrain_flow(model=OWN, corpus="corpus.txt", stages=3).validate()
    assert flow.models["policy"].stages == 3


def test_without_a_model_the_flows_build_the_builtin_gpt():
    flow = grpo_flow().validate()
    assert flow.models["actor"].build == GPT_BUILD and flow.models["actor"].stages == 2
    assert pretrain_flow(corpus="c.txt").validate().models["gpt"].stages == 4


def test_a_model_and_a_gpt_config_together_are_refused():
    with pytest.raises(ValueError, match="a model or a gpt config, not both"):
        grpo_flow(model=OWN, gpt={"n_layer": 2})


def test_a_model_that_is_not_a_model_is_refused_with_how_to_make_one():
    with pytest.raises(TypeError, match=r"Model\(name="):
        pretrain_flow(model="tinylm:TinyLM", corpus="c.txt")


@pytest.mark.parametrize("build", [rloo_flow, reinforce_pp_flow])
def test_rloo_and_reinforce_pp_train_the_given_model_with_the_kl_in_the_reward(build):
    flow = build(model=OWN, n=4).validate()
    assert flow.models["reference"].build == "tinylm:TinyLM"
    assert _model_of(flow, "update_actor") == "policy"
    assert _model_of(flow, "ref_logprobs") == "reference"
    assert "kl_token_rewards" in flow.nodes
    # the KL is in the token rewards, so the loss has no KL term of its own
    assert flow.nodes["update_actor"].config["loss"] == "ppo"


def test_reinforce_pp_baseline_swaps_in_the_group_baseline():
    flow = reinforce_pp_flow(model=OWN, n=4, baseline=True).validate()
    assert "reinforce_pp_baseline_advantages" in flow.nodes
    assert "reinforce_pp_advantages" not in flow.nodes


@pytest.mark.parametrize("build, kwargs", [(rloo_flow, {}),
                                           (reinforce_pp_flow, {"baseline": True})])
def test_a_group_baseline_with_one_sample_per_prompt_is_refused(build, kwargs):
    with pytest.raises(ValueError, match="needs n >= 2 samples per prompt"):
        build(n=1, **kwargs)
