"""LoRA settings a user gets wrong [Note: LoRA in flowkit/dsl/lora.py]: refused when the Model is
declared, or, for layers only the built model knows, by the executor in words that name the
model's own layers."""

from __future__ import annotations

import pytest

from executors.torch.errors import StageError
from executors.torch.models.built import held_model
from flowkit.dsl import Model
from tests.harness import op_context, tiny_gpt

GPT = "executors.torch.models.gpt:GPT"


def gpt(lora) -> Model:
    return Model(name="actor", build=GPT, config=tiny_gpt(), lora=lora)


def test_settings_are_normalized_with_their_defaults():
    model = gpt({"r": 8, "target_modules": ["c_attn", "c_attn"]})
    assert model.lora == {"r": 8, "alpha": 8.0, "target_modules": ["c_attn"], "dropout": 0.0,
                          "save": "adapter"}
    assert gpt(None).lora is None


@pytest.mark.parametrize(("lora", "words"), [
    ([("r", 8)], "must be a dict"),
    ({"r": 8}, "needs 'r'"),
    ({"rank": 8, "target_modules": ["c_attn"]}, "no setting 'rank'"),
    ({"r": 0, "target_modules": ["c_attn"]}, "r=0 must be an int >= 1"),
    ({"r": 2.5, "target_modules": ["c_attn"]}, "must be an int"),
    ({"r": 8, "alpha": -1, "target_modules": ["c_attn"]}, "alpha=-1 must be a number > 0"),
    ({"r": 8, "alpha": float("inf"), "target_modules": ["c_attn"]}, "alpha=inf must be"),
    ({"r": 8, "target_modules": "c_attn"}, "non-empty list"),
    ({"r": 8, "target_modules": []}, "non-empty list"),
    ({"r": 8, "target_modules": ["lm_head"]}, "output head 'lm_head'"),
    ({"r": 8, "target_modules": ["c_attn"], "dropout": 1.0}, r"dropout=1.0 must be .* \[0, 1\)"),
    ({"r": 8, "target_modules": ["c_attn"], "save": "full"}, "save='full' must be one of"),
])
def test_bad_settings_are_refused_when_the_model_is_declared(lora, words):
    with pytest.raises(ValueError, match=words):
        gpt(lora)


def test_a_value_head_with_lora_is_refused_when_declared():
    with pytest.raises(ValueError, match="a value head .* starts untrained: train it whole"):
        Model(name="critic", build=GPT, config={**tiny_gpt(), "value_head": True},
              lora={"r": 2, "target_modules": ["c_attn"]})


def _spec(lora: dict) -> dict:
    return {"model": "actor", "build": GPT, "stages": 2, "model_config": tiny_gpt(),
            "lora": gpt(lora).lora}


def test_targets_that_match_no_layer_name_the_models_linear_layers():
    with pytest.raises(StageError, match=r"match no layer .* named \['c_attn', 'c_fc', "):
        held_model(op_context(), _spec({"r": 2, "target_modules": ["q_proj"]}))


def test_a_target_that_is_not_linear_is_refused():
    with pytest.raises(StageError, match="'transformer.h.0.ln_1' is a LayerNorm, not an nn.Linear"):
        held_model(op_context(), _spec({"r": 2, "target_modules": ["h.0.ln_1"]}))


@pytest.mark.parametrize(("target", "words"), [
    ("c_attn", r"\['c_attn'\] match no layer of this llama; its "),
    ("self_attn", r"\['self_attn'\] name a layer peft cannot adapt .* "),
], ids=["not-found", "not-adaptable"])
def test_a_hugging_face_target_peft_cannot_use_is_refused_naming_the_linear_layers(target,
                                                                                   words):
    pytest.importorskip("peft", reason="the hf extra: pip install 'flowkit[hf]'")
    from executors.torch.models.hf import HFModelError
    from flowkit.runner.training_tasks import model_spec

    llama = {"architecture": "llama", "hf_config": dict(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=32, vocab_size=64, max_position_embeddings=32)}
    model = Model(name="actor", build="hf", config=llama,
                  lora={"r": 2, "target_modules": [target]})
    with pytest.raises(HFModelError, match=words + r"(its )?linear layers are named "
                                                   r"\['down_proj', "):
        held_model(op_context(), model_spec(model, 1))


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_our_lora_layer_computes_what_peft_s_does(dtype):
    """LoRALinear (the GPT's, and any model's without its own add_lora) against peft's
    lora.Linear with the same weights: forward and merged weight; in bfloat16 both keep the
    adapters in float32 (peft's autocast_adapter_dtype, which add_lora applies to HF models)."""
    peft = pytest.importorskip("peft", reason="the hf extra: pip install 'flowkit[hf]'")
    import torch
    from peft.functional import cast_adapter_dtype

    from executors.torch.lora import LoRALinear

    dtype = getattr(torch, dtype)
    torch.manual_seed(0)
    base = torch.nn.Linear(6, 5).to(dtype)
    ours = LoRALinear(base, r=3, alpha=7.0, dropout=0.0)
    wrapped = peft.inject_adapter_in_model(peft.LoraConfig(
        r=3, lora_alpha=7.0, target_modules=["layer"]), torch.nn.ModuleDict(
            {"layer": torch.nn.Linear(6, 5).to(dtype)}))
    cast_adapter_dtype(wrapped, "default")
    theirs = wrapped["layer"]
    adapters = torch.float64 if dtype == torch.float64 else torch.float32
    assert ours.lora_A.weight.dtype == theirs.lora_A["default"].weight.dtype == adapters
    assert ours.lora_B.weight.dtype == theirs.lora_B["default"].weight.dtype == adapters
    with torch.no_grad():
        theirs.base_layer.weight.copy_(base.weight)
        theirs.base_layer.bias.copy_(base.bias)
        ours.lora_B.weight.normal_()
        theirs.lora_A["default"].weight.copy_(ours.lora_A.weight)
        theirs.lora_B["default"].weight.copy_(ours.lora_B.weight)
    x = torch.randn(4, 6, dtype=torch.float64).to(dtype)
    assert ours(x).dtype == dtype
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-12)
    ours.merge()
    theirs.merge()
    torch.testing.assert_close(ours.base_layer.weight, theirs.base_layer.weight, rtol=0,
                               atol=1e-12)


def test_an_executor_checks_the_settings_a_task_brings():
    """A task's lora config is checked on the executor as on the Model: a peer's message is
    not trusted to be one a Model made."""
    spec = {**_spec({"r": 2, "target_modules": ["c_attn"]}), "lora": {"r": "two",
                                                                       "target_modules": ["c"]}}
    with pytest.raises(StageError, match="r='two' must be an int"):
        held_model(op_context(), spec)
