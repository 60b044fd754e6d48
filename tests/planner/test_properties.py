"""Every registered kind, on random sizes and uneven costs: valid, every op once, memory bounded."""

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowkit.planner import Costs, Kind, MemoryModel, ScheduleError, simulate
from flowkit.planner.schedules import build_schedule, get_spec, schedule_kinds
from tests.planner.strategies import draw_shares

# Peak memory bound per device, in MemoryModel units, for kinds with a closed form.
BOUNDS = {
    "gpipe": lambda p, m: m,
    "1f1b": lambda p, m: min(p, m),
    "zb-h1": lambda p, m: min(p, m),
    "zb-h2": lambda p, m: min(2 * p - 1, m),
    # Megatron's warm-up holds (v-1)*round + 2(p-1) + 1 chunk forwards of 1/v each, at most m.
    "interleaved-1f1b": lambda p, m: m,
}

@st.composite
def problems(draw):
    p = draw(st.integers(1, 8))
    costs = Costs(**draw_shares(draw, p), comm=draw(st.floats(0, 1)))
    return p, draw(st.integers(1, 24)), costs


@pytest.mark.parametrize("kind", schedule_kinds())
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=problems(), chunks=st.integers(1, 3))
def test_every_kind_is_valid_on_random_inputs(kind, problem, chunks):
    p, m, costs = problem
    spec = get_spec(kind)
    v = chunks if spec.chunks is None or chunks in spec.chunks else None
    try:
        schedule = build_schedule(kind, devices=p, microbatches=m, costs=costs, chunks=v)
    except ScheduleError:  # a builder bug: fail, showing the grid
        raise
    except ValueError:  # an input the kind documents it cannot take (skip would end the test)
        return
    per_stage = costs.for_placement(schedule.placement)
    result = simulate(schedule, per_stage, MemoryModel())
    ops = Counter((a.stage, a.kind, a.microbatch) for device in schedule.device_ops for a in device)
    assert max(ops.values()) == 1
    for stage in range(schedule.num_stages):
        for mb in range(m):
            fused = (stage, Kind.BW, mb) in ops
            needed = [Kind.F, Kind.BW] if fused else [Kind.F, Kind.B, Kind.W]
            assert all((stage, k, mb) in ops for k in needed)
    assert sum(ops.values()) == sum(len(d) for d in schedule.device_ops)
    if kind in BOUNDS:
        assert max(result.peak_memory) <= BOUNDS[kind](p, m) + 1e-9


@pytest.mark.parametrize("kind", schedule_kinds())
@settings(max_examples=15, deadline=None)
@given(problem=problems(), slack=st.floats(0, 2))
def test_memory_limit_is_respected_or_refused(kind, problem, slack):
    p, m, costs = problem
    limit = 1 + slack
    try:
        schedule = build_schedule(kind, devices=p, microbatches=m, costs=costs, memory_limit=limit)
    except ValueError:  # ScheduleError too: refusing is the right answer over the limit
        return
    result = simulate(schedule, costs.for_placement(schedule.placement))
    assert max(result.peak_memory) <= limit + 1e-9
