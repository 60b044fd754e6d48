"""Offloaded activations on the torch executor [Note: offloaded stash in
executors/torch/train/offload.py]: the same gradients bit for bit as without offload, and less
activation memory on the device by the executor's own accounting."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executors.torch import StageRunner
from executors.torch.models.gpt import split_gpt
from flowkit.planner import Action, Costs, Kind
from flowkit.planner.offload import offload_schedule
from flowkit.planner.schedules import build_schedule
from flowkit.planner.simulate import simulate
from tests.harness import seeded_gpt, tiny_gpt
from tests.torch.helpers import (
    KINDS,
    Driver,
    assert_grads_equal,
    make_data,
    make_stages,
    random_order,
    reference_grads,
)


def _global_order(schedule, costs) -> list[Action]:
    """Every action, copies included, in the order the simulation starts them (positive
    costs: a dependency ends before what waits for it starts)."""
    result = simulate(schedule, costs)
    ivs = [iv for dev in (*result.intervals, *result.copies) for iv in dev]
    return [iv.action for iv in sorted(ivs, key=lambda iv: (iv.start, iv.end))]


def _run(kind, stages, microbatches, order, offload=()):
    modules = make_stages(kind, stages)
    data = make_data(kind, microbatches)
    runners = [StageRunner(m, track_memory=True) for m in modules]
    driver = Driver(runners, data, offload=offload)
    for action in order:
        driver.step(action)
    assert all(r.stashed_bytes == 0 and not r.pending and r.device_bytes == 0 for r in runners)
    return modules, data, runners, driver.loss


def _offloaded(schedule):
    return {(a.stage, a.microbatch) for ops in schedule.device_ops for a in ops
            if a.kind is Kind.O}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("schedule_kind", ["1f1b", "zb-h1", "zb-h2"])
@pytest.mark.parametrize("which", ["half", "all"])
def test_offloaded_schedules_give_the_same_gradients_bit_for_bit(kind, schedule_kind, which):
    stages, m = 3, 6
    costs = Costs.uniform(stages, copy=0.5)
    plain = build_schedule(schedule_kind, devices=stages, microbatches=m, costs=costs)
    sched = offload_schedule(plain, costs, which)
    assert _offloaded(sched)
    base, data, _, base_loss = _run(kind, stages, m, _global_order(plain, costs))
    got, _, _, loss = _run(kind, stages, m, _global_order(sched, costs), _offloaded(sched))
    assert loss == base_loss
    for a, b in zip(base, got):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p.grad, q.grad), name
    _, expected = reference_grads(make_stages(kind, stages), data)
    assert_grads_equal(got, expected)


@pytest.mark.parametrize("schedule_kind", ["1f1b", "zb-h2"])
def test_measured_peak_activation_memory_falls_by_the_offloaded_share(schedule_kind):
    """The built-in GPT in float64, 8 blocks on 4 stages, 8 microbatches: stage 0's peak of
    activation bytes by the executor's accounting (what autograd saved and the deferred calls
    keep, less what sits in host memory) falls as the planner's memory model says it does
    (1F1B: 4 microbatches, with half 3, with all 2; ZB-H2: 7, 5, 2), within a few points
    (the stage's inputs and outputs stay on the device), and the gradients are the same bit
    for bit."""
    stages, m = 4, 8
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 64, (2, 33), generator=g) for _ in range(m)]
    data = [(b[:, :-1], b[:, 1:]) for b in batches]
    costs = Costs.uniform(stages, copy=0.0)
    plain = build_schedule(schedule_kind, devices=stages, microbatches=m, costs=costs)
    planned, measured, grads = {}, {}, {}
    for which in ("none", "half", "all"):
        sched = offload_schedule(plain, costs, which)
        parts = split_gpt(seeded_gpt(tiny_gpt(n_layer=8), dtype=torch.float64), stages)
        runners = [StageRunner(p, track_memory=True) for p in parts]
        driver = Driver(runners, data, offload=_offloaded(sched))
        for action in _global_order(sched, Costs.uniform(stages, copy=0.25)):
            driver.step(action)
        planned[which] = simulate(sched, costs).peak_memory[0]
        measured[which] = runners[0].peak_device_bytes
        grads[which] = [p.grad for part in parts for p in part.parameters()]
    for which in ("half", "all"):
        share = planned[which] / planned["none"]
        assert share < 0.8
        assert share - 0.01 < measured[which] / measured["none"] < share + 0.08
        assert all(torch.equal(a, b) for a, b in zip(grads["none"], grads[which]))


def test_a_backward_without_its_prefetch_brings_the_activations_back_itself():
    modules = make_stages("mlp_ln", 1)
    data = make_data("mlp_ln", 2)
    runner = StageRunner(modules[0], track_memory=True)
    runner.forward(0, *data[0], offload=True)
    assert runner.offloaded(0)
    held = runner.device_bytes
    runner.forward(1, *data[1])
    assert runner.device_bytes > 2 * held  # the plain forward keeps all its activations
    runner.backward(0)
    runner.backward(1)
    _, expected = reference_grads(make_stages("mlp_ln", 1), data)
    assert_grads_equal(modules, expected)


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(KINDS), stages=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_random_orders_with_random_offloads_and_prefetches(kind, stages, seed):
    """Any valid order, a random half of the forwards offloaded and each prefetched at a
    random point between its forward and its backward: the gradients of the run without."""
    rnd = random.Random(seed)
    order = random_order(stages, 4, rnd)
    chosen = {(a.stage, a.microbatch) for a in order if a.kind is Kind.F and rnd.random() < 0.5}
    with_copies = list(order)
    for s, mb in chosen:
        f = with_copies.index(Action(s, Kind.F, mb))
        back = next(i for i, a in enumerate(with_copies) if a.stage == s and a.microbatch == mb
                    and a.kind in (Kind.B, Kind.BW))
        with_copies.insert(f + 1, Action(s, Kind.O, mb))
        with_copies.insert(rnd.randint(f + 2, back + 1), Action(s, Kind.P, mb))
    base, *_ = _run(kind, stages, 4, order)
    got, *_ = _run(kind, stages, 4, with_copies, chosen)
    for a, b in zip(base, got):
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p.grad, q.grad)


def test_in_place_edit_after_an_offloading_forward_is_refused():
    module = copy.deepcopy(make_stages("linear", 1)[0])
    x = torch.randn(3, 6, dtype=torch.float64)

    class Edits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = module

        def forward(self, x, y):
            h = x * 2
            out = self.inner.layers[0](h)
            h.add_(1)  # after the linear read it
            return torch.nn.functional.mse_loss(out, y)

    runner = StageRunner(Edits())
    with pytest.raises(RuntimeError, match="modified in place"):
        runner.forward(0, x, torch.zeros(3, 6, dtype=torch.float64), offload=True)


def test_a_finished_microbatch_frees_its_stash_without_a_garbage_collection():
    """Found on an H200: a stash that held its own hooks made a reference cycle, so every
    finished microbatch's prefetched activations stayed on the device until Python's cyclic
    collector ran, and the peak rose with offload instead of falling."""
    import gc
    import weakref

    modules = make_stages("mlp_ln", 1)
    data = make_data("mlp_ln", 1)
    runner = StageRunner(modules[0])
    gc.disable()
    try:
        runner.forward(0, *data[0], offload=True)
        stash = weakref.ref(runner._mbs[0].host)
        runner.prefetch(0)
        runner.backward(0)
        assert stash() is None
    finally:
        gc.enable()
