"""A run checkpoint of a LoRA model [Note: LoRA in flowkit/dsl/lora.py]: the executor's state
holds the adapters, their optimizer states and the buffers, not the frozen base weights, which
building the model again gives back; loading it restores every parameter, and a flow whose LoRA
settings differ is refused, naming them."""

from __future__ import annotations

import pytest
import torch

from executors.torch.errors import StageError
from executors.torch.models.built import held_model
from executors.torch.state import load_state, save_state
from executors.torch.train.held_stage import held_stage
from executors.torch.train.pipeline_ops import new_optimizer
from flowkit.dsl import Model
from flowkit.runner.training_tasks import model_spec
from tests.harness import finished, op_context, tiny_gpt

GPT = "executors.torch.models.gpt:GPT"
LORA = {"r": 2, "target_modules": ["c_attn", "c_fc"]}


def _spec(lora=LORA) -> dict:
    model = Model(name="actor", build=GPT, config={**tiny_gpt(), "dtype": "float64", "seed": 5},
                  stages=2, lora=lora)
    return model_spec(model, 2)


def _trained_state(tmp_path):
    """An executor holding stage 0 of the LoRA actor after one AdamW step, saved."""
    ctx, spec = op_context(), _spec()
    stage = held_stage(ctx, {**spec, "stage": 0})
    stage.optimizer = new_optimizer(stage.module, lr=1e-2)
    for p in stage.module.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    stage.optimizer.step()
    path = tmp_path / "exec0.pt"
    finished(ctx, save_state(ctx, path=str(path)))
    return ctx, spec, path


def test_the_state_holds_the_adapters_and_loads_back_every_parameter(tmp_path):
    ctx, spec, path = _trained_state(tmp_path)
    saved = torch.load(path, weights_only=True)["models"][0]["parts"][0]
    assert saved and all(".lora_" in name for name in saved)  # no frozen base weight
    again = op_context("exec1")
    assert load_state(again, path=str(path), models={"actor": spec}) == 1
    before = held_model(ctx, spec).parts[0].state_dict()
    after = held_model(again, spec).parts[0].state_dict()
    assert before.keys() == after.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    moved = held_stage(again, {**spec, "stage": 0}).optimizer.state_dict()["state"]
    assert moved and all("exp_avg" in s for s in moved.values())


def test_a_flow_with_other_lora_settings_is_refused_naming_them(tmp_path):
    _, _, path = _trained_state(tmp_path)
    for other in (None, {**LORA, "r": 4}):
        with pytest.raises(StageError, match="was saved with lora="):
            load_state(op_context("exec1"), path=str(path), models={"actor": _spec(other)})
    # where the adapters are saved to is no part of the model
    assert load_state(op_context("exec2"), path=str(path),
                      models={"actor": _spec({**LORA, "save": "merged"})}) == 1


def test_a_whole_copy_with_a_tied_head_saves_no_base_weight(tmp_path):
    """A one-stage GPT ties its head to its embedding: one frozen weight, two names."""
    ctx, spec = op_context(), {**_spec(), "stages": 1}
    held_model(ctx, spec).version = 1  # a loaded copy, as a generator's: saved whole
    path = tmp_path / "exec0.pt"
    finished(ctx, save_state(ctx, path=str(path)))
    saved = torch.load(path, weights_only=True)["models"][0]["parts"][0]
    assert saved and all(".lora_" in name for name in saved)
