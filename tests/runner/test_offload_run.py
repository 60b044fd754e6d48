"""Offloading schedules on simulator executor processes [Note: offload in the runtime in
flowkit/ops/executor_ops.py, simulated copy engines in executors/sim.py]: each executor's
activation memory peaks where the planner's memory model says."""

from __future__ import annotations

import pytest

from flowkit.planner import Costs, MemoryModel
from flowkit.planner.offload import offload_schedule
from flowkit.planner.schedules import build_schedule
from flowkit.planner.simulate import simulate
from flowkit.runner.pipeline import stage_costs_config, submit_schedule
from tests.harness import executor_cluster

UNIT = 0.02  # seconds of F, B and W: dispatch (about a millisecond an op) stays small beside it


@pytest.fixture(scope="module")
def sims():
    with executor_cluster(4, kind="sim") as cluster:
        yield cluster


def _measured(ctl, infos, schedule, costs) -> tuple[float, list[float]]:
    """The measured makespan and each executor's peak activation memory (microbatches)."""
    infos = infos[:schedule.num_devices]
    for info in infos:  # the peak from here on
        ctl.submit("activation_memory", config={"reset": True}, executor=info.id).result(10)
    run = submit_schedule(ctl, schedule, infos,
                          config_for=stage_costs_config(costs, memory=MemoryModel()))
    run.wait(timeout=60)
    peaks = [ctl.submit("activation_memory", config={"reset": True},
                        executor=info.id).result(10) for info in infos]
    assert all(p["unit"] == "microbatches" and p["now"] == pytest.approx(0) for p in peaks), peaks
    return run.measured()["makespan"], [p["peak"] for p in peaks]


@pytest.mark.parametrize("which", ["all", "half"])
def test_the_simulator_executors_hold_the_memory_the_planner_says(sims, which):
    """Each executor's activation memory peaks where the planner's memory model says (within
    a microbatch: a copy's end and an op's start may come in either order). How long the step
    takes is the planner's figure and `flowkit run --offload`'s, not a test's: timings on a
    shared machine are noise."""
    ctl, infos = sims
    costs = Costs.uniform(4, F=UNIT, B=UNIT, W=UNIT, copy=1.5 * UNIT)
    plain = build_schedule("zb-h2", devices=4, microbatches=8, costs=costs)
    offloaded = offload_schedule(plain, costs, which)
    assert any(a.kind.is_copy for ops in offloaded.device_ops for a in ops)
    _measured(ctl, infos, plain, costs)  # warms up sockets, imports and caches
    base_peaks = _measured(ctl, infos, plain, costs)[1]
    runs = [_measured(ctl, infos, offloaded, costs)[1] for _ in range(2)]
    peaks = [min(device) for device in zip(*runs)]
    assert base_peaks == pytest.approx(list(simulate(plain, costs).peak_memory))
    expected = simulate(offloaded, costs).peak_memory
    assert all(abs(got - want) <= 1.0 for got, want in zip(peaks, expected)), \
        (which, peaks, list(expected), base_peaks)
    assert peaks[0] < base_peaks[0]
