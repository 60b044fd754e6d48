"""The simulator's semantics: [Note: pipeline dependencies] in flowkit/planner/simulate.py."""

import math

import attrs
import pytest

from flowkit.planner import Action, Costs, Placement, Schedule, ScheduleError, simulate
from flowkit.planner.schedules import build_schedule


def _schedule(*device_texts: str, stage_to_device=None, microbatches=1) -> Schedule:
    device_ops = [[Action.parse(t) for t in text.split()] for text in device_texts]
    placement = Placement(stage_to_device or range(len(device_ops)))
    return Schedule(
        kind="test", placement=placement, microbatches=microbatches, device_ops=device_ops
    )


def _starts(result) -> dict[str, float]:
    return {str(iv.action): iv.start for ivs in result.intervals for iv in ivs}


def test_dependencies_and_comm_on_cross_device_edges_only():
    # Two stages on two devices, then the same two stages on one device.
    costs = Costs(F=[1, 2], B=[3, 4], W=[5, 6], comm=0.5)
    two = simulate(_schedule("0F0 0B0 0W0", "1F0 1B0 1W0"), costs)
    assert _starts(two) == {"0F0": 0, "1F0": 1.5, "1B0": 3.5, "1W0": 7.5, "0B0": 8.0, "0W0": 11.0}
    one = simulate(_schedule("0F0 1F0 1B0 0B0 1W0 0W0", stage_to_device=[0, 0]), costs)
    assert _starts(one)["1F0"] == 1.0  # same device: no comm
    assert _starts(one)["0B0"] == 7.0
    assert one.makespan == 1 + 2 + 4 + 3 + 6 + 5


def test_bw_counts_as_the_backward_downstream_waits_for():
    costs = Costs.uniform(2, F=1, B=1, W=1)
    result = simulate(_schedule("0F0 0BW0", "1F0 1BW0"), costs)
    assert _starts(result)["0BW0"] == 4.0  # after 1BW0 ends (2 + 2)


def test_deadlock_is_reported_with_the_stuck_actions():
    # Device 0 waits for 1B0 before it sends 0F0, which device 1 needs before 1F0.
    schedule = _schedule("0F1 0B0 0W0 0F0 0B1 0W1", "1F0 1B0 1W0 1F1 1B1 1W1", microbatches=2)
    with pytest.raises(ScheduleError, match="deadlock") as err:
        simulate(schedule, Costs.uniform(2))
    assert err.value.marked == {Action(0, "B", 0), Action(1, "F", 0)}


def test_duplicate_action_is_an_error():
    with pytest.raises(ScheduleError, match="runs twice"):
        simulate(_schedule("0F0 0F0 0BW0"), Costs.uniform(1))


def test_bubble_rate_is_max_span_minus_busiest_over_max_span():
    costs = Costs(F=[1, 3], B=[1, 3], W=[1, 3])
    result = simulate(_schedule("0F0 0BW0", "1F0 1BW0"), costs)
    # device 1 runs 1F0 [1, 4], 1BW0 [4, 10]; device 0 runs 0F0 [0, 1], 0BW0 [10, 12]
    assert result.device_span == (12.0, 9.0)
    assert result.busy == (3.0, 9.0)
    assert result.bubble_rate == pytest.approx((12 - 9) / 12)


def test_peak_memory_follows_the_memory_model():
    result = simulate(
        _schedule("0F0 0F1 0B0 0F2 0W0 0B1 0W1 0BW2", microbatches=3), Costs.uniform(1)
    )
    # +1 +1 -0.5 +1 (2.5) -0.5 -0.5 -0.5 -1
    assert result.peak_memory == (2.5,)


def test_misplaced_action_is_an_error():
    with pytest.raises(ScheduleError, match="lives on device 1"):
        simulate(_schedule("0F0 1F0 0BW0 1BW0", "", stage_to_device=[0, 1]), Costs.uniform(2))


def test_a_per_op_cost_is_added_to_every_op_and_once_to_a_fused_backward():
    placement = Placement.one_per_device(1)
    fused = Schedule(kind="t", placement=placement, microbatches=1,
                     device_ops=[[Action.parse("0F0"), Action.parse("0BW0")]])
    split = Schedule(kind="t", placement=placement, microbatches=1,
                     device_ops=[[Action.parse(t) for t in ("0F0", "0B0", "0W0")]])
    costs = Costs.uniform(1, F=1, B=2, W=3, comm=0)
    with_overhead = attrs.evolve(costs, per_op=0.5)
    assert simulate(fused, with_overhead).makespan == simulate(fused, costs).makespan + 1.0
    assert simulate(split, with_overhead).makespan == simulate(split, costs).makespan + 1.5
    assert with_overhead.to_json()["per_op"] == 0.5 and "per_op" not in costs.to_json()


def test_bubble_rate_is_never_negative_from_float_noise():
    costs = Costs.uniform(2, F=0.1, B=0.1, W=0.1)
    sched = build_schedule("zb-v", devices=2, microbatches=5, costs=costs)
    result = simulate(sched, costs.for_placement(sched.placement))
    assert max(result.busy) > max(result.device_span)  # the noise this guards against
    assert result.bubble_rate == 0.0 and math.copysign(1, result.bubble_rate) == 1
