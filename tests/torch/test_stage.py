"""StageRunner against plain autograd: every gradient, in every order a schedule allows."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executors.torch import StageRunner
from executors.torch.errors import StageError
from flowkit.planner.ir import Action, Kind
from tests.torch.helpers import (
    KINDS,
    Driver,
    assert_grads_equal,
    make_data,
    make_stages,
    random_order,
    reference_grads,
    run_order,
    schedule_order,
)

MICROBATCHES = 4


def _check(kind: str, stages: int, order: list[Action], *, split: bool = True) -> None:
    modules = make_stages(kind, stages)
    data = make_data(kind, MICROBATCHES)
    loss, expected = reference_grads(modules, data)
    runners = [StageRunner(m) for m in modules]
    got = run_order(runners, data, order, split=split)
    assert abs(got - loss) < 1e-12
    assert_grads_equal(modules, expected)
    assert all(r.stashed_bytes == 0 and not r.pending for r in runners)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zb-h2"])
def test_schedules_match_plain_autograd(kind, stages, schedule):
    _check(kind, stages, schedule_order(schedule, stages, MICROBATCHES))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_forwards_that_do_not_split_match_plain_autograd(kind, stages, schedule):
    """[Note: a fused backward]: a forward without the recorder, then its BW as one plain
    pass; B then W after such a forward (no schedule asks it) is still right, by the generic
    split."""
    _check(kind, stages, schedule_order(schedule, stages, MICROBATCHES), split=False)


@pytest.mark.parametrize("kind", KINDS)
def test_zb_v_two_stages_per_device(kind):
    _check(kind, 4, schedule_order("zb-v", 4, MICROBATCHES))


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(KINDS), stages=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_random_valid_orders_match_plain_autograd(kind, stages, seed):
    _check(kind, stages, random_order(stages, MICROBATCHES, random.Random(seed)))


def _count_forwards(module: torch.nn.Module) -> dict[str, int]:
    counts: dict[str, int] = {}

    def hook(name):
        def count(*_):
            counts[name] = counts.get(name, 0) + 1

        return count

    for name, sub in module.named_modules():
        sub.register_forward_hook(hook(name))
    return counts


@pytest.mark.parametrize("kind", KINDS)
def test_forward_runs_once_and_weight_grads_wait_for_w(kind):
    (stage,) = make_stages(kind, 1)
    data = make_data(kind, MICROBATCHES)
    _, expected = reference_grads([stage], data)
    counts = _count_forwards(stage)
    runner = StageRunner(stage)
    for m, (x, y) in enumerate(data):
        runner.forward(m, x, y)
    calls_after_f = dict(counts)
    for m in range(MICROBATCHES):
        runner.backward_input(m)
    # B leaves every weight gradient to W: linear ones and generic ones alike
    assert all(p.grad is None for p in stage.parameters())
    assert runner.stashed_bytes > 0
    for m in range(MICROBATCHES):
        runner.backward_weight(m)
    assert counts == calls_after_f  # neither B nor W ran any module's forward again
    assert counts[""] == MICROBATCHES
    assert_grads_equal([stage], expected)


class _CountBackward(torch.autograd.Function):
    """Identity whose backward counts its calls: a link of the input-gradient chain."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _CountBackward.calls += 1
        return g


def test_w_never_walks_the_input_gradient_chain():
    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(4), torch.nn.LayerNorm(4)
            self.scale = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            h = _CountBackward.apply(self.ln1(x) * self.scale)
            return (torch.tanh(self.ln2(h)) * self.scale).sum()

    stage = Stage().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    ref = copy.deepcopy(stage)
    ref(x).backward()
    runner = StageRunner(stage)
    runner.forward(0, x)
    _CountBackward.calls = 0
    runner.backward_input(0)
    assert _CountBackward.calls == 1
    runner.backward_weight(0)
    assert _CountBackward.calls == 1  # W ran the consumer nodes only, not the chain between
    for p, q in zip(stage.parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max() < 1e-12


def test_linear_weight_grads_appear_per_w():
    (stage,) = make_stages("linear", 1)
    data = make_data("linear", 2)
    runner = StageRunner(stage)
    for m, (x, y) in enumerate(data):
        runner.forward(m, x, y)
        runner.backward_input(m)
    first = stage.layers[0][0].weight
    assert first.grad is None
    runner.backward_weight(0)
    _, expected0 = reference_grads([make_stages("linear", 1)[0]], data[:1])
    assert torch.allclose(first.grad, expected0[0]["layers.0.0.weight"], atol=1e-12, rtol=0)
    runner.backward_weight(1)
    _, expected = reference_grads([make_stages("linear", 1)[0]], data)
    assert_grads_equal([stage], expected)


@pytest.mark.parametrize("kind", KINDS)
def test_fused_bw_equals_b_then_w(kind):
    split = make_stages(kind, 2)
    fused = copy.deepcopy(split)
    data = make_data(kind, 2)
    forwards = [Action(s, Kind.F, m) for m in range(2) for s in range(2)]
    backs = [(s, m) for m in range(2) for s in (1, 0)]
    b_then_w = [Action(s, k, m) for s, m in backs for k in (Kind.B, Kind.W)]
    bw = [Action(s, Kind.BW, m) for s, m in backs]
    run_order([StageRunner(m) for m in split], data, forwards + b_then_w)
    run_order([StageRunner(m) for m in fused], data, forwards + bw)
    for a, b in zip(split, fused):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p.grad, q.grad), name


def _stash_bytes(runner: StageRunner, mb) -> int:
    """Bytes the runner holds for W of microbatch `mb` (0 before its B and after its W)."""
    state = runner._mbs.get(mb)
    return state.stashed_bytes if state is not None else 0


def test_stash_is_accounted_per_microbatch_and_released_by_w():
    modules = make_stages("mlp_ln", 2)
    data = make_data("mlp_ln", 3)
    runners = [StageRunner(m) for m in modules]
    driver = Driver(runners, data)
    for a in schedule_order("zb-h2", 2, 3):
        runner = runners[a.stage]
        before = _stash_bytes(runner, a.microbatch)
        driver.step(a)
        after = _stash_bytes(runner, a.microbatch)
        if a.kind == Kind.B:
            assert before == 0 and after > 0
        if a.kind in (Kind.W, Kind.BW):
            assert after == 0
    assert [r.stashed_bytes for r in runners] == [0, 0]


def test_integer_inputs_get_no_gradient_and_float_inputs_do():
    (stage,) = make_stages("embed_conv", 1)
    x, y = make_data("embed_conv", 1)[0]
    runner = StageRunner(stage)
    runner.forward(0, x, y)
    assert runner.backward(0) == (None, None)
    mid = make_stages("mlp_ln", 2)[0]
    runner = StageRunner(mid)
    act = torch.randn(2, 5, 6, dtype=torch.float64)
    out = runner.forward(0, act)
    assert not out.requires_grad  # the graph stays inside the runner
    (g,) = runner.backward(0, torch.ones_like(out))
    assert g.shape == act.shape and g.dtype == act.dtype


def test_misuse_is_a_clear_error():
    modules = make_stages("linear", 2)
    runner = StageRunner(modules[0])
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    with pytest.raises(StageError, match="microbatch 0, which has no forward"):
        runner.backward_input(0, torch.ones(2, 5, 6, dtype=torch.float64))
    with pytest.raises(StageError, match="microbatch 7, which has no forward"):
        runner.backward_weight(7)
    out = runner.forward(0, x)
    with pytest.raises(StageError, match="ran twice"):
        runner.forward(0, x)
    with pytest.raises(StageError, match="backward_input has not run yet"):
        runner.backward_weight(0)
    with pytest.raises(StageError, match="needs a scalar loss"):
        runner.backward_input(0)
    with pytest.raises(StageError, match="got 2 grad_outputs for 1"):
        runner.backward_input(0, out, out)
    runner.backward_input(0, torch.ones_like(out))
    with pytest.raises(StageError, match="backward_input already ran"):
        runner.backward_input(0, torch.ones_like(out))
    runner.backward_weight(0)
    with pytest.raises(StageError, match="no forward pending"):
        runner.backward_weight(0)
    runner.forward(0, x)  # a finished microbatch id may be reused in the next step


def test_in_place_edit_of_a_linear_input_is_refused():
    class Bad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 3)

        def forward(self, x):
            h = x * 2
            y = self.fc(h)
            h.add_(1)  # autograd does not mind (fc saved no h), but dW = dYᵀh would be wrong
            return (y + h).sum()

    runner = StageRunner(Bad().double())
    runner.forward(0, torch.randn(2, 3, dtype=torch.float64))
    runner.backward_input(0)
    with pytest.raises(RuntimeError, match="modified in place"):
        runner.backward_weight(0)


def test_every_tensor_input_reaches_the_stage_through_to_device(monkeypatch):
    """[Note: transfers without a wait]: an activation off the wire goes to the stage's device
    queued (pinned, non-blocking on a GPU), never by a pageable copy that waits."""
    from executors.torch.train import stage as stage_module

    moved: list[torch.device] = []

    def recorded(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        moved.append(device)
        return t.to(device)

    monkeypatch.setattr(stage_module, "to_device", recorded)
    runner = StageRunner(torch.nn.Linear(3, 2))
    runner.forward("mb", torch.ones(4, 3))
    assert moved == [torch.device("cpu")]
