"""[Note: a state written in the background in executors/torch/state.py]: save_state copies the
executor's state when it runs and a thread writes the copy; the task ends once the file is on
disk. What the tasks after it change is not in the file, and a write that fails fails the task,
naming why."""

from __future__ import annotations

import hashlib

import pytest
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
    saved = torch.load(tmp_path / "exec0.pt", weights_only=True)["models"][0]
    for name, value in saved["parts"][0].items():
        assert torch.equal(value, before[name]), name
    for index, state in saved["optimizers"][0]["state"].items():
        assert torch.equal(state["exp_avg"], moments[index])
    assert not ctx.background["state_writer"].busy()


def test_a_write_that_fails_fails_the_task_naming_why(tmp_path, monkeypatch):
    ctx, _ = _training_stage()

    def full_disk(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("executors.torch.state.torch.save", full_disk)
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
