"""The planner's timing of data parallel × pipeline parallel: each device's all-reduce after its
last action, what the schedule hides of it, and the ring all-reduce's cost."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowkit.planner import Costs
from flowkit.planner.replicas import simulate_replicas
from flowkit.planner.schedules import build_schedule
from flowkit.planner.simcosts import SimCosts


def _schedule(kind: str, devices: int, microbatches: int, costs: Costs):
    return build_schedule(kind, devices=devices, microbatches=microbatches, costs=costs)


def test_without_an_all_reduce_the_step_is_the_pipelines_makespan():
    costs = Costs.uniform(4, F=1.0, B=1.0, W=1.0)
    result = simulate_replicas(_schedule("1f1b", 4, 8, costs), costs, 0.0)
    assert result.step == pytest.approx(result.pipeline.makespan)
    assert result.exposed == 0.0 and result.hidden == 1.0


def test_in_1f1b_only_the_first_devices_all_reduce_shows():
    """The last device ends its backward passes 3 (B + W) before the first device does: an
    all-reduce shorter than that hides behind them, the first device's never does."""
    costs = Costs.uniform(4, F=1.0, B=1.0, W=1.0)
    result = simulate_replicas(_schedule("1f1b", 4, 8, costs), costs, 2.0)
    assert result.exposed == pytest.approx(2.0)
    ends = {r.device: r.end for r in result.reductions}
    assert ends[3] < result.pipeline.makespan < ends[0]
    # devices 1-3 end their backward passes at least one B + W (2) before device 0: their
    # all-reduces end by the pipeline's end, device 0's shows whole: 6 of 8 seconds hidden
    shown = {r.device: max(0.0, r.end - result.pipeline.makespan) for r in result.reductions}
    assert shown == {0: pytest.approx(2.0), 1: pytest.approx(0.0), 2: pytest.approx(0.0),
                     3: pytest.approx(0.0)}
    assert result.hidden == pytest.approx(6.0 / 8.0)


def test_a_device_reduces_its_stages_one_after_the_other_after_its_last_action():
    costs = Costs.uniform(2, F=1.0, B=1.0, W=1.0)
    schedule = _schedule("zb-v", 2, 4, costs)  # two stages a device
    result = simulate_replicas(schedule, costs.for_placement(schedule.placement),
                               [0.5, 0.25, 0.25, 0.5])
    by_device: dict[int, list] = {}
    for r in result.reductions:
        by_device.setdefault(r.device, []).append(r)
    for device, reductions in by_device.items():
        last = result.pipeline.intervals[device][-1].end
        reductions.sort(key=lambda r: r.stage)
        assert reductions[0].start == pytest.approx(last)
        assert reductions[1].start == pytest.approx(reductions[0].end)
        assert all(r.ready <= r.start for r in reductions)


@settings(max_examples=60, deadline=None)
@given(devices=st.integers(1, 4), microbatches=st.integers(1, 8),
       kind=st.sampled_from(["gpipe", "1f1b", "zb-h1"]),
       allreduce=st.floats(0.0, 5.0), f=st.floats(0.1, 2.0), b=st.floats(0.1, 2.0),
       w=st.floats(0.1, 2.0))
def test_the_step_is_bounded_by_the_makespan_and_every_all_reduce_shown(
        devices, microbatches, kind, allreduce, f, b, w):
    costs = Costs.uniform(devices, F=f, B=b, W=w)
    result = simulate_replicas(_schedule(kind, devices, microbatches, costs), costs, allreduce)
    makespan = result.pipeline.makespan
    assert makespan - 1e-9 <= result.step <= makespan + allreduce * devices + 1e-9
    assert 0.0 <= result.hidden <= 1.0 + 1e-9
    assert sorted(r.stage for r in result.reductions) == list(range(devices))


def test_allreduce_per_stage_must_match_the_stages():
    costs = Costs.uniform(2, F=1.0, B=1.0, W=1.0)
    with pytest.raises(ValueError, match="one per stage"):
        simulate_replicas(_schedule("1f1b", 2, 4, costs), costs, [1.0, 2.0, 3.0])


def test_the_ring_all_reduce_cost():
    """2(D-1)/D of a device's share of the gradients each way, at the link's rate."""
    costs = SimCosts(grad_bytes=4e9, allreduce_gbps=100, allreduce_latency=2e-5)
    assert costs.allreduce_s(8, 4) == pytest.approx(2 * 7 / 8 * 1e9 * 8 / 100e9 + 2e-5)
    assert costs.allreduce_s(1, 4) == 0.0
    assert SimCosts.parse("grad_bytes=1e9,allreduce_gbps=25").allreduce_gbps == 25
    with pytest.raises(ValueError, match="allreduce_gbps must be a finite number > 0"):
        SimCosts(allreduce_gbps=0)
