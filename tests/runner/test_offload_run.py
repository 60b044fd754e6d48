"""Offloading schedules on simulator executor processes [Note: offload in the runtime in
flowkit/ops/executor_ops.py, simulated copy engines in executors/sim.py]: the copies cost what the
planner's simulation says they cost (nothing where hidden, the predicted delay where a prefetch
comes late), and each executor's activation memory peaks where the planner's memory model says."""

from __future__ import annotations

import pytest

from flowkit.planner import Action, Costs, Kind, MemoryModel, Schedule
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


def _late_prefetch(schedule: Schedule) -> Schedule:
    """1F1B with stage 0's microbatch 0 offloaded and its prefetch right before its B: a copy
    longer than the op before it delays the B by the rest."""
    ops = list(schedule.device_ops[0])
    ops.insert(ops.index(Action(0, Kind.F, 0)) + 1, Action(0, Kind.O, 0))
    back = next(a for a in ops if a.kind in (Kind.B, Kind.BW) and a.microbatch == 0)
    ops.insert(ops.index(back), Action(0, Kind.P, 0))
    return Schedule(kind=schedule.kind, placement=schedule.placement,
                    microbatches=schedule.microbatches,
                    device_ops=[ops, *schedule.device_ops[1:]])


@pytest.mark.parametrize("case", ["zb-h2 all", "zb-h2 half"])
def test_the_simulator_executors_take_the_copies_time_and_memory_as_the_planner(sims, case):
    ctl, infos = sims
    kind, _, which = case.partition(" ")
    devices = 4 if kind == "zb-h2" else 2
    copy = (4 if which == "late prefetch" else 1.5) * UNIT
    costs = Costs.uniform(devices, F=UNIT, B=UNIT, W=UNIT, copy=copy)
    plain = build_schedule(kind, devices=devices, microbatches=8, costs=costs)
    offloaded = _late_prefetch(plain) if which == "late prefetch" else \
        offload_schedule(plain, costs, which)
    assert any(a.kind.is_copy for ops in offloaded.device_ops for a in ops)
    predicted = simulate(offloaded, costs).makespan / simulate(plain, costs).makespan
    _measured(ctl, infos, plain, costs)  # warms up sockets, imports and caches
    # the least of three runs: other processes share the machine's cores
    base_makespan, base_peaks = min(_measured(ctl, infos, plain, costs) for _ in range(3))
    makespan, peaks = min(_measured(ctl, infos, offloaded, costs) for _ in range(3))
    assert makespan / base_makespan == pytest.approx(predicted, abs=0.06)
    if which == "late prefetch":
        assert predicted > 1.02  # the case shows a delay
    assert base_peaks == pytest.approx(list(simulate(plain, costs).peak_memory))
    expected = simulate(offloaded, costs).peak_memory
    assert all(abs(got - want) <= 1.0 for got, want in zip(peaks, expected)), \
        (case, peaks, list(expected), base_peaks, makespan / base_makespan, predicted)
    assert peaks[0] < base_peaks[0] or which == "late prefetch"
