"""An executor's state keeps its random generators [Note: CUDA random state in
executors/torch/state.py]: a generator state (a uint8 tensor) goes through the file and back
unchanged, a damaged one is refused naming it, the CUDA generators are saved and set where this
process used CUDA (a stub of torch.cuda stands in for a GPU), and a state without them (a CPU
run's, an older flowkit's) loads as before."""

from __future__ import annotations

import random

import pytest
import torch

from executors.optable import OpContext
from executors.torch import state as executor_state
from executors.torch.errors import StageError
from executors.torch.state import checked_rng, load_state, state_of
from executors.torch.state_file import decode, encode


class _StubCuda:
    """Two CUDA devices as torch.cuda would show them, each with its own generator state."""

    def __init__(self, monkeypatch, *, initialized: bool = True, devices: int = 2) -> None:
        self.states = {i: torch.arange(16, dtype=torch.uint8) + i for i in range(devices)}
        self.set: dict[int, torch.Tensor] = {}
        for name, fn in {"is_available": lambda: True, "is_initialized": lambda: initialized,
                         "device_count": lambda: devices,
                         "get_rng_state": lambda i: self.states[i].clone(),
                         "set_rng_state": lambda v, i: self.set.__setitem__(i, v.clone())
                         }.items():
            monkeypatch.setattr(torch.cuda, name, fn)


def _write(state: tuple[dict, dict], path) -> str:
    path.write_bytes(encode(*state))
    return str(path)


def _saved(ctx: OpContext, path) -> str:
    return _write(state_of(ctx), path)


def _ctx() -> OpContext:
    return OpContext(name="e", device="cpu", tags=())


def test_a_generator_state_goes_through_the_file_and_back_unchanged(tmp_path):
    torch.manual_seed(7)
    random.seed(7)
    path = _saved(_ctx(), tmp_path / "state")
    expected = torch.rand(4), random.random()
    torch.manual_seed(0)
    random.seed(0)
    assert load_state(_ctx(), path=path) == 0
    assert torch.equal(torch.rand(4), expected[0]) and random.random() == expected[1]


@pytest.mark.parametrize("bad, shown", [
    (torch.zeros(16, dtype=torch.float32), "a torch.float32 tensor of shape (16,)"),
    (torch.zeros(2, 8, dtype=torch.uint8), "a torch.uint8 tensor of shape (2, 8)"),
    (torch.zeros(0, dtype=torch.uint8), "a torch.uint8 tensor of shape (0,)"),
    (torch.zeros(1 << 17, dtype=torch.uint8), "a torch.uint8 tensor of shape (131072,)"),
    ([1, 2, 3], "a list"),
])
def test_a_malformed_generator_state_is_refused_naming_it(bad, shown):
    with pytest.raises(StageError) as error:
        checked_rng(bad, "torch_rng", "exec-0")
    assert str(error.value).startswith(f"exec-0: torch_rng is {shown}, not a generator state")


@pytest.mark.parametrize("field, value, says", [
    ("rng.torch", torch.zeros(5056, dtype=torch.int64), "torch_rng is a torch.int64 tensor"),
    ("rng.cuda.0", torch.zeros(3, 3), r"cuda_rng\[0\] is a torch.float32 tensor"),
    ("rng.cuda.x", torch.zeros(16, dtype=torch.uint8), "cuda_rng is not a map"),
    ("rng.cuda.-1", torch.zeros(16, dtype=torch.uint8), "cuda_rng is not a map"),
    # the right kind of tensor of the wrong size: torch would refuse it only once set
    ("rng.torch", torch.zeros(100, dtype=torch.uint8), r"torch_rng is .* shape \(100,\)"),
    ("rng.cuda.0", torch.zeros(17, dtype=torch.uint8), r"cuda_rng\[0\] is .* \(17,\)"),
])
def test_a_file_with_a_damaged_generator_state_is_refused_before_anything_changes(
        tmp_path, field, value, says):
    meta, tensors = state_of(_ctx())
    _write((meta, {**tensors, field: value}), tmp_path / "state")
    ctx = _ctx()
    ctx.state["torch_models"] = {"kept": "until the file is known good"}
    with pytest.raises(StageError, match=rf"{tmp_path / 'state'}: {says}"):
        load_state(ctx, path=str(tmp_path / "state"))
    assert ctx.state["torch_models"] == {"kept": "until the file is known good"}


def test_the_cuda_generators_are_saved_and_set_where_cuda_was_used(tmp_path, monkeypatch):
    cuda = _StubCuda(monkeypatch)
    saved = state_of(_ctx())
    assert sorted(k for k in saved[1] if k.startswith("rng.cuda.")) == ["rng.cuda.0", "rng.cuda.1"]
    assert all(torch.equal(saved[1][f"rng.cuda.{i}"], cuda.states[i]) for i in (0, 1))
    _write(saved, tmp_path / "state")
    load_state(_ctx(), path=str(tmp_path / "state"))
    assert sorted(cuda.set) == [0, 1]
    assert all(torch.equal(cuda.set[i], cuda.states[i]) for i in (0, 1))


def test_a_process_that_never_used_cuda_saves_no_cuda_state(monkeypatch):
    _StubCuda(monkeypatch, initialized=False)
    assert not [k for k in state_of(_ctx())[1] if k.startswith("rng.cuda.")]


def test_a_state_without_cuda_generators_loads_and_sets_none(tmp_path, monkeypatch):
    path = _saved(_ctx(), tmp_path / "state")  # this CPU: none saved, as in an older file
    _, tensors = decode((tmp_path / "state").read_bytes(), path)
    assert not [k for k in tensors if k.startswith("rng.cuda.")]
    cuda = _StubCuda(monkeypatch)
    assert load_state(_ctx(), path=path) == 0
    assert cuda.set == {}


def test_a_device_the_executor_does_not_see_is_refused_naming_it(tmp_path, monkeypatch):
    _StubCuda(monkeypatch, devices=2)
    path = _saved(_ctx(), tmp_path / "state")
    _StubCuda(monkeypatch, devices=1)
    with pytest.raises(StageError, match=r"CUDA device\(s\) \[1\], and this executor sees 1"):
        load_state(_ctx(), path=path)


def test_cuda_generators_in_a_file_loaded_without_cuda_are_skipped_with_a_warning(
        tmp_path, monkeypatch, caplog):
    _StubCuda(monkeypatch)
    path = _saved(_ctx(), tmp_path / "state")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda *a: pytest.fail("set without CUDA"))
    assert load_state(_ctx(), path=path) == 0
    assert "has no CUDA" in caplog.text
    assert executor_state.usable_cuda_rng({}, path) == {}
