"""Offloading schedules on simulator executor processes [Note: offload in the runtime in
flowkit/ops/executor_ops.py], [Note: simulated copy engines in executors/sim/ops.py]: each
executor's activation memory peaks where the planner's memory model says."""

from __future__ import annotations

import pytest

from flowkit.planner import Costs, MemoryModel
from flowkit.planner.offload import offload_schedule
from flowkit.planner.schedules import build_schedule
from flowkit.planner.simulate import simulate
from flowkit.runner.pipeline import stage_costs_config, submit_schedule

UNIT = 0.02  # seconds of F, B and W: dispatch (about a millisecond an op) stays small beside it


@pytest.fixture(scope="module")
def sims(pool):
    with pool.shared(4, kind="sim") as cluster:
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


def test_a_run_with_offload_auto_fits_the_memory_limit(pool):
    """ZB-H2 (p = 4, m = 8) holds 7 microbatches on device 0 and does not fit a limit of 5;
    `--offload auto --memory-limit 5` runs the schedule that offload lets fit, and the
    executors hold no more than that (to the microbatch a copy and an op may race by)."""
    from pathlib import Path

    from dataflows.model_ops import Backprop, OptimizerStep
    from flowkit.dsl import Flow, Model, collect
    from flowkit.planner.lower import lower_flow
    from flowkit.planner.simcosts import SimCosts
    from flowkit.runner.config import RunConfigError
    from flowkit.runner.flowrun import FlowRunner
    from flowkit.runner.setup import with_training_options
    from tests.runner import flowdefs

    def flow():
        model = Model(name="m", build="pkg.models:build", stages=4, tags=("train",))
        with Flow("offload_auto") as built:
            stats = Backprop(model)(flowdefs.samples(count=16), schedule="zb-h2",
                                    microbatches=8)
            OptimizerStep(model)(collect(stats))
        return built

    with pytest.raises(RunConfigError, match="auto chooses none, half or all under a memory "
                                             "limit, and there is none"):
        with_training_options(flow(), stages=None, microbatches=None, schedule=None,
                              offload="auto")
    with pytest.raises(RunConfigError, match="'backprop': device 0 peaks at 7 > memory limit 5 "
                                             r".*let offload make room \(--offload auto\)"):
        with_training_options(flow(), stages=None, microbatches=None, schedule=None,
                              memory_limit=5.0)  # ZB-H2 does not fit 5 without offload
    auto = with_training_options(flow(), stages=None, microbatches=None, schedule=None,
                                 offload="auto", memory_limit=5.0)
    code = [str(Path(flowdefs.__file__))]
    costs = SimCosts(F=UNIT, B=UNIT, W=UNIT, copy=0.5 * UNIT)
    with pool.shared(4, kind="sim", tags=("train",), code=code) as (ctl, _):
        runner = FlowRunner(ctl, lower_flow(auto), sim_costs=costs)
        metrics = runner.run_step(0).metrics
    schedule = runner.training["m"].trained[0]
    assert any(a.kind.is_copy for ops in schedule.device_ops for a in ops)
    assert max(simulate(schedule, costs.stage_costs(4)).peak_memory) <= 5.0
    assert 0 < metrics["m/peak_activation_microbatches"] <= 6.0
