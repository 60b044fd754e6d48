"""The planner's timing of data parallel × pipeline parallel: each device's all-reduce after its
last action, what the schedule hides of it, and the ring all-reduce's cost."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowkit.planner import Costs
from flowkit.planner.replicas import buckets_for, simulate_replicas
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
    """In the order the device ended them, as the runtime's reduce_grads run: ZB-V ends its
    later stage first."""
    costs = Costs.uniform(2, F=1.0, B=1.0, W=1.0)
    schedule = _schedule("zb-v", 2, 4, costs)  # two stages a device
    result = simulate_replicas(schedule, costs.for_placement(schedule.placement),
                               [0.5, 0.25, 0.25, 0.5])
    by_device: dict[int, list] = {}
    for r in result.reductions:
        by_device.setdefault(r.device, []).append(r)
    for device, reductions in by_device.items():
        last = result.pipeline.intervals[device][-1].end
        reductions.sort(key=lambda r: r.start)
        assert [r.stage for r in reductions] == [3 - device, device]
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


# [Note: overlapped all-reduce in flowkit/planner/replicas.py]: buckets reduced as the device's
# last W (or BW) of the stage makes them final, on one communication stream a device

_KINDS = st.sampled_from(["gpipe", "1f1b", "zb-h1", "zb-h2"])


@settings(max_examples=60, deadline=None)
@given(devices=st.integers(1, 4), microbatches=st.integers(1, 8), kind=_KINDS,
       allreduce=st.floats(0.0, 5.0), buckets=st.integers(1, 6), f=st.floats(0.1, 2.0),
       b=st.floats(0.1, 2.0), w=st.floats(0.1, 2.0))
def test_overlap_never_makes_a_step_longer_and_hides_a_share_in_0_1(
        devices, microbatches, kind, allreduce, buckets, f, b, w):
    costs = Costs.uniform(devices, F=f, B=b, W=w)
    schedule = _schedule(kind, devices, microbatches, costs)
    after = simulate_replicas(schedule, costs, allreduce)
    overlapped = simulate_replicas(schedule, costs, allreduce, overlap=True, buckets=buckets)
    assert overlapped.step <= after.step + 1e-9
    assert overlapped.pipeline.makespan - 1e-9 <= overlapped.step
    assert 0.0 <= overlapped.hidden <= 1.0
    assert overlapped.allreduce == pytest.approx(after.allreduce)
    for r in overlapped.reductions:
        assert len(r.spans) == buckets
        assert all(s0 <= s1 <= t0 + 1e-12 for (s0, s1), (t0, _) in zip(r.spans, r.spans[1:]))


@settings(max_examples=30, deadline=None)
@given(devices=st.integers(1, 4), microbatches=st.integers(1, 8), kind=_KINDS,
       buckets=st.integers(1, 6), f=st.floats(0.1, 2.0), w=st.floats(0.1, 2.0))
def test_without_communication_both_models_are_the_makespan(devices, microbatches, kind,
                                                            buckets, f, w):
    costs = Costs.uniform(devices, F=f, B=f, W=w)
    schedule = _schedule(kind, devices, microbatches, costs)
    for overlap in (False, True):
        result = simulate_replicas(schedule, costs, 0.0, overlap=overlap, buckets=buckets)
        assert result.step == pytest.approx(result.pipeline.makespan)
        assert result.hidden == 1.0


def _flat(spans):
    return [t for span in spans for t in span]


def test_overlapped_buckets_start_inside_the_last_w_by_hand():
    """1F1B, 2 devices, 2 microbatches, F = B = W = 1: its backward is fused (BW, 2 units).
    Device 1 runs 1F0 [1,2] 1BW0 [2,4] 1F1 [4,5] 1BW1 [5,7]; device 0 ends with 0BW1 [7,9].
    An all-reduce of 3 in 2 buckets of 1.5: device 1's ready at 6 and 7 -> [6, 7.5], [7.5, 9];
    device 0's at 8 and 9 -> [8, 9.5], [9.5, 11]. After the last action: device 0 reduces
    [9, 12], device 1 [7, 10]. Hidden before 9: 3 + 1 of 6 overlapped, 2 of 6 after."""
    costs = Costs.uniform(2, F=1.0, B=1.0, W=1.0)
    schedule = _schedule("1f1b", 2, 2, costs)
    assert [str(a) for a in schedule.device_ops[1]] == ["1F0", "1BW0", "1F1", "1BW1"]
    overlapped = simulate_replicas(schedule, costs, 3.0, overlap=True, buckets=2)
    after = simulate_replicas(schedule, costs, 3.0)
    assert overlapped.pipeline.makespan == pytest.approx(9.0)
    spans = {r.device: r.spans for r in overlapped.reductions}
    assert _flat(spans[1]) == pytest.approx([6.0, 7.5, 7.5, 9.0])
    assert _flat(spans[0]) == pytest.approx([8.0, 9.5, 9.5, 11.0])
    assert overlapped.step == pytest.approx(11.0) and after.step == pytest.approx(12.0)
    assert overlapped.hidden == pytest.approx(4.0 / 6.0)
    assert after.hidden == pytest.approx(2.0 / 6.0)


def test_a_split_backward_reduces_in_the_last_w_not_the_last_b():
    """ZB-H1: the stage's last W makes its gradients final; its buckets wait for that W's
    parts, whatever ran before it."""
    costs = Costs.uniform(2, F=1.0, B=1.0, W=1.0)
    schedule = _schedule("zb-h1", 2, 4, costs)
    result = simulate_replicas(schedule, costs, 1.0, overlap=True, buckets=4)
    for r in result.reductions:
        last_w = max((i for i in result.pipeline.intervals[r.device]
                      if i.action.stage == r.stage and i.action.kind.value == "W"),
                     key=lambda i: i.end)
        readies = [last_w.start + (k + 1) * 0.25 for k in range(4)]
        assert all(start >= ready - 1e-12 for (start, _), ready in zip(r.spans, readies))
        assert r.spans[0][0] == pytest.approx(readies[0]) and r.ready == pytest.approx(last_w.end)


def test_a_device_with_two_stages_reduces_every_bucket_on_one_stream():
    costs = Costs.uniform(2, F=1.0, B=1.0, W=1.0)
    schedule = _schedule("zb-v", 2, 4, costs)  # two stages a device
    result = simulate_replicas(schedule, costs.for_placement(schedule.placement),
                               [0.5, 0.25, 0.25, 0.5], overlap=True, buckets=[3, 1, 2, 2])
    for device in (0, 1):
        spans = sorted(s for r in result.reductions if r.device == device for s in r.spans)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))
    assert [len(r.spans) for r in result.reductions] == [3, 1, 2, 2]


def test_bucket_counts_follow_the_stage_gradient_bytes():
    assert buckets_for(0) == 1 and buckets_for(25 << 20) == 1 and buckets_for(1 + (25 << 20)) == 2
    assert buckets_for(1e9) == 39
    costs = Costs.uniform(2, F=1.0, B=1.0, W=1.0)
    with pytest.raises(ValueError, match="buckets needs one value or one per stage"):
        simulate_replicas(_schedule("1f1b", 2, 4, costs), costs, 1.0, overlap=True,
                          buckets=[1, 2, 3])
