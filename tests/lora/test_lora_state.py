"""A run checkpoint of a LoRA model [Note: LoRA in flowkit/dsl/lora.py]: the executor's state
holds the adapters and their optimizer states, not the frozen base weights, which building the
model again gives back; loading it restores every parameter, and a flow whose LoRA
settings differ is refused, naming them."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from executors.torch.errors import StageError
from executors.torch.layout_free import fill_optimizer
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
    """An executor holding both stages of the LoRA actor after one AdamW step, saved."""
    ctx, spec = op_context(), _spec()
    for index in (0, 1):
        stage = held_stage(ctx, {**spec, "stage": index})
        stage.optimizer = new_optimizer(stage.module, lr=1e-2)
        for p in stage.module.parameters():
            if p.requires_grad:
                p.grad = torch.randn_like(p)
        stage.optimizer.step()
    path = tmp_path / "exec0.pt"
    finished(ctx, save_state(ctx, path=str(path)))
    return ctx, spec, path


def _load(ctx, path, spec) -> int:
    """load_state as a resume asks an executor that trains the actor."""
    return load_state(ctx, path=str(path), files=[str(path)], models={"actor": spec},
                      trains=["actor"])


def test_the_state_holds_the_adapters_and_loads_back_every_parameter(tmp_path):
    ctx, spec, path = _trained_state(tmp_path)
    saved = [name for name in safetensors.torch.load_file(path) if "/param/" in name]
    assert saved and all(".lora_" in name for name in saved)  # no frozen base weight
    again = op_context("exec1")
    assert _load(again, path, spec) == 1
    for index in (0, 1):
        before = held_model(ctx, spec).parts[index].state_dict()
        after = held_model(again, spec).parts[index].state_dict()
        assert before.keys() == after.keys()
        for name, value in before.items():
            assert torch.equal(after[name], value), name
    # the optimizer made at the stage's first step takes the saved states
    stage = held_stage(again, {**spec, "stage": 0})
    optimizer = new_optimizer(stage.module, lr=1e-2)
    fill_optimizer(optimizer, stage.module, stage.resumed)
    saved_optimizer = held_stage(ctx, {**spec, "stage": 0}).optimizer
    moved = optimizer.state_dict()["state"]
    assert moved and all("exp_avg" in s for s in moved.values())
    for number, state in saved_optimizer.state_dict()["state"].items():
        assert torch.equal(moved[number]["exp_avg"], state["exp_avg"])


def test_a_flow_with_other_lora_settings_is_refused_naming_them(tmp_path):
    _, _, path = _trained_state(tmp_path)
    for other in (None, {**LORA, "r": 4}):
        with pytest.raises(StageError, match="was saved with lora="):
            _load(op_context("exec1"), path, _spec(other))
    # where the adapters are saved to is no part of the model
    assert _load(op_context("exec2"), path, _spec({**LORA, "save": "merged"})) == 1


def test_a_whole_copy_with_a_tied_head_saves_no_base_weight(tmp_path):
    """A one-stage GPT ties its head to its embedding: one frozen weight, two names."""
    ctx, spec = op_context(), {**_spec(), "stages": 1}
    held_model(ctx, spec).version = 1  # a loaded copy, as a generator's: saved whole
    path = tmp_path / "exec0.pt"
    finished(ctx, save_state(ctx, path=str(path)))
    saved = list(safetensors.torch.load_file(path))
    assert [name for name in saved if name.startswith("actor/copy1/param/")]
    assert all(".lora_" in name for name in saved if "/param/" in name)
