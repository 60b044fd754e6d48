"""A schedule's bubbles from the simulator, and work fitted into them without moving an action
[Note: bubbles in flowkit/planner/bubbles.py]."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowkit.planner import Costs, simulate
from flowkit.planner.bubbles import bubbles, fill
from flowkit.planner.fused import fuse, simulate_fused
from flowkit.planner.schedules import build_schedule

from .strategies import draw_shares

KINDS = ("1f1b", "zb-h1", "zb-h2", "gpipe", "interleaved-1f1b")


@st.composite
def simulated(draw):
    p, m = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    kind = draw(st.sampled_from(KINDS))
    chunks = 2 if kind == "interleaved-1f1b" else None
    if kind == "interleaved-1f1b" and m % p:
        m = p * max(1, m // p)
    share = Costs(**draw_shares(draw, p),
                  comm=draw(st.sampled_from((0.0, 0.3))))
    schedule = build_schedule(kind, devices=p, microbatches=m, costs=share, chunks=chunks)
    return simulate(schedule, share.for_placement(schedule.placement))


def _overlap(spans):
    spans = sorted(spans)
    return any(a_end > b_start + 1e-9 for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(result=simulated(), units=st.lists(st.floats(0, 4), max_size=30))
def test_bubbles_are_the_idle_time_and_a_fill_never_moves_an_action(result, units):
    slots = bubbles(result)
    devices = len(result.intervals)
    # the slots and the actions tile every device from 0 to the makespan
    idle = devices * result.makespan - sum(result.busy)
    assert sum(s.length for s in slots) == pytest.approx(idle, abs=1e-6)
    for slot in slots:
        assert slot.length > 0
        assert slot.before is None or slot.before.start == pytest.approx(slot.end)
        assert slot.after is None or slot.after.end == pytest.approx(slot.start)
    filling = fill(slots, units)
    placed = {f.unit for f in filling.placed}
    assert placed | set(filling.left) == set(range(len(units)))
    assert not placed & set(filling.left)
    for device in range(devices):
        actions = [(iv.start, iv.end) for iv in result.intervals[device] if iv.end > iv.start]
        fills = [(f.start, f.end) for f in filling.placed if f.device == device and f.end > f.start]
        assert not _overlap(actions + fills)
        for start, end in fills:  # inside one of the device's bubbles
            assert any(s.start - 1e-9 <= start and end <= s.end + 1e-9
                       for s in slots if s.device == device)
    # what is left fits in no room the placed units leave
    for unit in filling.left:
        for slot in slots:
            used = sum(f.end - f.start for f in filling.placed if f.device == slot.device
                       and slot.start - 1e-9 <= f.start and f.end <= slot.end + 1e-9)
            assert slot.length - used < units[unit] + 1e-9
    in_turn, filled = filling.extra_time(units, devices)
    assert filled <= in_turn + 1e-9


def test_one_f_one_b_bubbles_are_the_warm_up_and_cool_down():
    """1F1B, p = 4, m = 8, unit costs (F = B = W = 1): makespan 33, each device idle 9; the
    last device waits 3 for the first microbatch and 6 after its last backward."""
    result = simulate(build_schedule("1f1b", devices=4, microbatches=8,
                                     costs=Costs.uniform(4)), Costs.uniform(4))
    slots = bubbles(result)
    last = [s for s in slots if s.device == 3]
    assert [(s.start, s.length) for s in last] == [(0.0, 3.0), (27.0, 6.0)]
    assert last[0].after is None and str(last[0].before.action) == "3F0"
    assert str(last[1].after.action) == "3BW7" and last[1].before is None
    assert [sum(s.length for s in slots if s.device == d) for d in range(4)] == [9.0] * 4
    filling = fill(slots, [0.5] * 40)
    assert len(filling.placed) == 40 and filling.used == 20.0
    assert filling.extra_time([0.5] * 40, 4) == (5.0, 0.0)  # 38 in turn, 33 filled
    assert bubbles(result, min_length=2.0) == [s for s in slots if s.length > 2.0]


def test_a_fused_schedule_has_bubbles_too_and_work_larger_than_any_is_left():
    """Two 1F1B pipelines fused (p = 4, m = 8, unit costs): 51 where each device works 48,
    so 12 idle in all."""
    costs = Costs.uniform(4)
    one = build_schedule("1f1b", devices=4, microbatches=8, costs=costs)
    result = simulate_fused(fuse([one, one], costs, devices=[range(4), [3, 2, 1, 0]],
                                 evals=100), [costs, costs])
    slots = bubbles(result)
    assert result.makespan == 51.0 and sum(s.length for s in slots) == 12.0
    longest = max(s.length for s in slots)
    filling = fill(slots, [longest + 1.0, 0.0])
    assert filling.left == (0,) and [f.unit for f in filling.placed] == [1]


def test_a_cost_that_is_not_a_finite_non_negative_number_is_refused():
    with pytest.raises(ValueError, match="unit 1 costs -1.0"):
        fill([], [1.0, -1.0])
    with pytest.raises(ValueError, match="unit 0 costs nan"):
        fill([], [float("nan")])
