"""[Note: a state written in the background in executors/torch/state.py]: save_state copies the
executor's state when it runs and a thread writes the copy (a safetensors file, by the unsplit
model's names); the task ends once the file is on disk. What the tasks after it change is not
in the file, and a write that fails fails the task, naming why."""

from __future__ import annotations

import hashlib

import pytest
import safetensors.torch
import torch

from executors.optable import Deferred
from executors.torch.state import save_state
from executors.torch.train.held_stage import held_stage
from executors.torch.train.pipeline_ops import new_optimizer
from flowkit.dsl import Model
from flowkit.runner.training_tasks import model_spec
from tests.harness import finished, op_context, tiny_gpt


def _training_stage():
    model = Model(name="actor", build="executors.torch.models.gpt:GPT",
                  config={**tiny_gpt(), "dtype": "float64", "seed": 3}, stages=2)
    ctx = op_context()
    stage = held_stage(ctx, {**model_spec(model, 2), "stage": 0})
    stage.optimizer = new_optimizer(stage.module, lr=1e-2)
    for p in stage.module.parameters():
        p.grad = torch.ones_like(p)
    stage.optimizer.step()
    return ctx, stage


def stage_names_of(ctx) -> dict[str, str]:
    """Stage 0's local parameter names -> the unsplit model's."""
    (held,) = ctx.state["torch_models"].values()
    return held.layout.names[0]


def test_the_file_holds_the_state_when_the_task_ran_not_what_changed_after(tmp_path):
    ctx, stage = _training_stage()
    before = {name: value.clone() for name, value in stage.module.state_dict().items()}
    moments = {i: s["exp_avg"].clone() for i, s in stage.optimizer.state_dict()["state"].items()}
    pending = save_state(ctx, path=str(tmp_path / "exec0.pt"))
    assert isinstance(pending, Deferred)  # the executor goes on while the thread writes
    with torch.no_grad():  # the next step's training, before the file is written
        for p in stage.module.parameters():
            p.add_(1.0)
        stage.optimizer.step()
    written = finished(ctx, pending)
    data = (tmp_path / "exec0.pt").read_bytes()  # hashed as it was written
    assert written == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()} and data
    # layout-free: by the unsplit GPT's names [Note: layout-free checkpoints]
    saved = safetensors.torch.load(data)
    names = {local: f"actor/train/param/{unsplit}"
             for local, unsplit in stage_names_of(ctx).items()}
    for name, value in before.items():
        if name in names:
            assert torch.equal(saved[names[name]], value), name
    params = [p for group in stage.optimizer.param_groups for p in group["params"]]
    local = {id(p): name for name, p in stage.module.named_parameters()}
    for index, moment in moments.items():
        unsplit = names[local[id(params[index])]].replace("/param/", "/optim/exp_avg/")
        assert torch.equal(saved[unsplit], moment)
    assert not ctx.background["state_writer"].busy()


def test_a_write_that_fails_fails_the_task_naming_why(tmp_path, monkeypatch):
    ctx, _ = _training_stage()

    def full_disk(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("executors.torch.state.encode", full_disk)
    pending = save_state(ctx, path=str(tmp_path / "exec0.pt"))
    with pytest.raises(OSError, match="No space left"):
        finished(ctx, pending)
    assert not ctx.background["state_writer"].busy()


def test_an_existing_file_is_refused_at_once(tmp_path):
    ctx, _ = _training_stage()
    (tmp_path / "exec0.pt").write_bytes(b"someone else's")
    with pytest.raises(FileExistsError):
        save_state(ctx, path=str(tmp_path / "exec0.pt"))


def test_a_save_that_fails_before_writing_leaves_no_file_and_no_open_descriptor(
        tmp_path, monkeypatch):
    import os

    ctx, _ = _training_stage()

    def out_of_memory(_ctx):
        raise MemoryError("the host copy")

    monkeypatch.setattr("executors.torch.state.state_of", out_of_memory)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(MemoryError):
            save_state(ctx, path=str(tmp_path / "exec0.pt"))
    assert not (tmp_path / "exec0.pt").exists()
    assert len(os.listdir("/proc/self/fd")) == before
