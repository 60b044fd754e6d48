"""The optimizer step's AdamW is torch.optim.AdamW without its first call's import of
torch._dynamo [Note: AdamW without dynamo in executors/torch/train/pipeline_ops.py]: the same
parameters, state and state dicts, step by step, and no torch._dynamo in the executor."""

from __future__ import annotations

import copy
import subprocess
import sys

import torch

from executors.torch.train.pipeline_ops import new_optimizer


def _trained(make_optimizer, steps: int, *, resume_from: dict | None = None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 1)).double()
    optimizer = make_optimizer(model)
    if resume_from is not None:
        model.load_state_dict(resume_from["model"])
        optimizer.load_state_dict(resume_from["optimizer"])
    x = torch.randn(32, 8, dtype=torch.float64)
    for _ in range(steps):
        model(x).pow(2).mean().backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)
    return model, optimizer


def _torch_adamw(model):
    params = list(model.parameters())
    return torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)


def _ours(model):
    return new_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


def _assert_same(a, b):
    (model_a, opt_a), (model_b, opt_b) = a, b
    assert all(torch.equal(x, y) for x, y in zip(model_a.parameters(), model_b.parameters()))
    state_a, state_b = opt_a.state_dict(), opt_b.state_dict()
    assert state_a["param_groups"] == state_b["param_groups"]
    assert state_a["state"].keys() == state_b["state"].keys()
    for key, values in state_a["state"].items():
        assert values.keys() == state_b["state"][key].keys()
        assert all(torch.equal(v, state_b["state"][key][n]) for n, v in values.items())


def test_the_optimizer_steps_and_saves_as_torchs_adamw_does():
    assert type(_ours(torch.nn.Linear(2, 2))).__mro__[1] is torch.optim.AdamW
    _assert_same(_trained(_ours, 5), _trained(_torch_adamw, 5))


def test_a_saved_state_loads_and_steps_on_as_torchs_adamw_does():
    model, optimizer = _trained(_ours, 3)
    saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    # a loaded state's tensors are the saved ones, stepped in place: each run loads a copy
    _assert_same(_trained(_ours, 2, resume_from=copy.deepcopy(saved)),
                 _trained(_torch_adamw, 5))
    _assert_same(_trained(_torch_adamw, 2, resume_from=copy.deepcopy(saved)),
                 _trained(_torch_adamw, 5))


def test_stepping_saving_and_loading_import_no_torch_dynamo():
    """In a fresh interpreter, as an executor is: importing it costs a core 1.3 s."""
    script = (
        "import sys, torch\n"
        "from executors.torch.train.pipeline_ops import new_optimizer\n"
        "model = torch.nn.Linear(4, 4)\n"
        "optimizer = new_optimizer(model, lr=1e-3)\n"
        "model(torch.randn(2, 4)).sum().backward()\n"
        "optimizer.step()\n"
        "new_optimizer(model).load_state_dict(optimizer.state_dict())\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# -- [Note: AdamW kernels] ---------------------------------------------------------------------
def test_the_kernel_is_fused_on_cuda_and_the_single_tensor_loop_elsewhere():
    from executors.torch.train.pipeline_ops import adamw_kernel

    assert adamw_kernel({"cuda"}) == {"fused": True}
    assert adamw_kernel({"cpu"}) == {"foreach": False}
    assert adamw_kernel({"cuda", "cpu"}) == {"foreach": False}  # fused needs every one on CUDA
    group = _ours(torch.nn.Linear(2, 2)).param_groups[0]
    assert group["foreach"] is False and not group["fused"]


def test_a_state_saved_by_the_fused_kernel_loads_and_steps_with_this_devices_kernel():
    """A GPU run's optimizer state (fused) resumed on a CPU steps as the CPU's own state does."""
    model, optimizer = _trained(_ours, 3)
    saved = optimizer.state_dict()
    as_if_fused = copy.deepcopy(saved)
    for group in as_if_fused["param_groups"]:
        group.update(fused=True, foreach=None)
    resumed = _trained(_ours, 2, resume_from={"model": model.state_dict(),
                                               "optimizer": as_if_fused})
    assert all(not g["fused"] and g["foreach"] is False for g in resumed[1].param_groups)
    _assert_same(resumed, _trained(_torch_adamw, 5))


def test_a_state_of_another_shape_is_left_for_loading_to_refuse():
    import pytest

    optimizer = _ours(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="different number of parameter groups"):
        optimizer.load_state_dict({"state": {}, "param_groups": []})
