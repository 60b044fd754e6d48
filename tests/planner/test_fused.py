"""Fused multi-model schedules: each model's order kept, never longer than one model after the
other, within the memory cap, and RLHFuse's gain where the second pipeline runs the other way."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowkit.planner import Costs, ScheduleError, simulate
from flowkit.planner.fused import (
    FusedSchedule,
    fuse,
    fused_report,
    sequential,
    simulate_fused,
)
from flowkit.planner.offload import offload_schedule
from flowkit.planner.schedules import build_schedule

from .strategies import draw_shares

KINDS = ("1f1b", "zb-h1", "zb-h2", "gpipe")


@st.composite
def fusions(draw):
    p, m = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    costs, schedules = [], []
    for _ in range(2):
        share = Costs(**draw_shares(draw, p), comm=draw(st.sampled_from((0.0, 0.3))))
        schedule = build_schedule(draw(st.sampled_from(KINDS)), devices=p, microbatches=m,
                                  costs=share)
        schedules.append(schedule)
        costs.append(share.for_placement(schedule.placement))
    order = draw(st.permutations(range(p)))
    return schedules, costs, [range(p), order]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fusion=fusions(), limited=st.booleans())
def test_a_fused_schedule_keeps_each_order_and_beats_one_after_the_other(fusion, limited):
    schedules, costs, devices = fusion
    alone = [max(simulate(s, c).peak_memory) for s, c in zip(schedules, costs)]
    limit = max(alone) if limited else None
    fused = fuse(schedules, costs, devices=devices, memory_limit=limit, evals=20)
    # the constructor checks every model's list on every device against its own schedule
    FusedSchedule(schedules=fused.schedules, devices=fused.devices, device_ops=fused.device_ops)
    got = simulate_fused(fused, costs)
    in_turn = simulate_fused(sequential(schedules, devices), costs)
    assert got.makespan <= in_turn.makespan + 1e-9
    assert in_turn.makespan <= sum(simulate(s, c).makespan for s, c in zip(schedules, costs)) \
        + 1e-9
    if limit is not None:
        assert max(got.peak_memory) <= limit + 1e-9


def test_a_reversed_second_pipeline_fills_the_first_ones_bubbles():
    """1F1B, p = 4, m = 8, unit costs: each pipeline alone takes 33 with a bubble rate of .27;
    one after the other 66; fused with the critic's stages the other way round, 51 (the
    warm-up of one runs in the cool-down of the other) and within 5 microbatches a device
    where the two alone hold 4 each."""
    costs = Costs.uniform(4)
    one = build_schedule("1f1b", devices=4, microbatches=8, costs=costs)
    fused = fuse([one, one], costs, devices=[range(4), [3, 2, 1, 0]],
                 names=("actor", "critic"), evals=100)
    report = fused_report(fused, costs)
    assert [m["makespan"] for m in report["models"]] == [33.0, 33.0]
    assert report["sum_makespan"] == 66.0
    assert report["fused"]["makespan"] == 51.0
    assert report["fused"]["bubble_rate"] < report["models"][0]["bubble_rate"] / 4
    assert max(report["fused"]["peak_memory"]) <= 5.0
    same_way = fuse([one, one], costs, evals=100)
    assert simulate_fused(same_way, costs).makespan == 57.0  # one shared warm-up and cool-down


def test_fusing_under_a_memory_limit_trades_time_for_memory():
    costs = Costs.uniform(4)
    one = build_schedule("zb-h1", devices=4, microbatches=8, costs=costs)
    free = simulate_fused(fuse([one, one], costs, evals=50), costs)
    capped = simulate_fused(fuse([one, one], costs, memory_limit=6.0, evals=50), costs)
    assert max(free.peak_memory) == 8.0 and max(capped.peak_memory) <= 6.0
    assert free.makespan <= capped.makespan < 2 * simulate(one, costs).makespan


def test_a_limit_not_even_one_model_at_a_time_meets_is_refused():
    costs = Costs.uniform(4)
    one = build_schedule("1f1b", devices=4, microbatches=8, costs=costs)
    with pytest.raises(ScheduleError, match="need memory 4 a device even one after the other, "
                                            "over the limit 3") as err:
        fuse([one, one], costs, memory_limit=3.0)
    assert err.value.over_memory


def test_offloaded_pipelines_fuse_with_their_copies():
    costs = Costs.uniform(4, copy=0.5)
    one = offload_schedule(build_schedule("1f1b", devices=4, microbatches=8, costs=costs),
                           costs, "all")
    fused = fuse([one, one], costs, devices=[range(4), [3, 2, 1, 0]], evals=50)
    got = simulate_fused(fused, costs)
    assert got.makespan < 2 * simulate(one, costs).makespan
    assert any(got.copies)
    for ops in fused.device_ops:  # every copy still follows a compute op of its own model
        for before, (model, action) in zip(ops, ops[1:]):
            if action.kind.is_copy:
                assert before[0] == model


def test_a_fused_schedule_refuses_a_model_out_of_its_order():
    one = build_schedule("1f1b", devices=2, microbatches=2, costs=Costs.uniform(2))
    fused = sequential([one, one], names=("actor", "critic"))
    swapped = list(fused.device_ops[0])
    swapped[0], swapped[1] = swapped[1], swapped[0]  # actor's 0F1 before its 0F0
    with pytest.raises(ValueError, match="device 0 must run actor's device 0 actions in their "
                                         "own order"):
        FusedSchedule(schedules=fused.schedules, devices=fused.devices,
                      device_ops=[swapped, fused.device_ops[1]], names=fused.names)
    with pytest.raises(ValueError, match="critic's devices must be distinct"):
        sequential([one, one], devices=[[0, 1], [1, 1]], names=("actor", "critic"))
    with pytest.raises(ValueError, match="device map names 3"):
        sequential([one, one], devices=[[0, 1], [0, 1, 2]])


def test_an_interleaving_that_deadlocks_names_where():
    """Device 0 runs the actor's backward before the critic's forward, which device 1 waits
    for before the actor's forward and backward that device 0 waits for: no device can
    move."""
    one = build_schedule("1f1b", devices=2, microbatches=1, costs=Costs.uniform(2))
    first, second = one.device_ops  # 0F0 0BW0 | 1F0 1BW0
    fused = FusedSchedule(schedules=[one, one], devices=[[0, 1], [0, 1]],
                          device_ops=[[(0, a) for a in first] + [(1, a) for a in first],
                                      [(1, a) for a in second] + [(0, a) for a in second]],
                          names=("actor", "critic"))
    with pytest.raises(ScheduleError, match="deadlock: .*device 0 waits at actor:0BW0.*"
                                            "device 1 waits at critic:1F0"):
        simulate_fused(fused, Costs.uniform(2))
