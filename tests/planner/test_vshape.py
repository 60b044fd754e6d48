"""V-shape schedules (zb-v, v-half, v-min): valid, within their memory caps, and near the
published bubbles when F = B = W.

Memory is in MemoryModel units (one microbatch on one device share); a chunk op is half a share.
Caps: ZB-V p; V-Half (p+2)/2 and V-Min (p+4)/3 ("Pipeline Parallelism with Controllable
Memory"), never above p.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowkit.planner import Costs, MemoryModel, Placement, simulate, validate
from flowkit.planner.schedules import build_schedule
from flowkit.planner.schedules.greedy import Problem, to_schedule
from flowkit.planner.schedules.vfill import fill_v_orders
from tests.planner.paper import TABLE5, TABLE5_IDS, ZBV_REPOSITORY_TABLE5, ZBV_REPOSITORY_TESTS
from tests.planner.strategies import draw_shares

CAPS = {
    "zb-v": lambda p: p,
    "v-half": lambda p: min(p, (p + 2) / 2),
    "v-min": lambda p: min(p, (p + 4) / 3),
}
V_KINDS = sorted(CAPS)


def _run(kind, p, m, costs, **kwargs):
    schedule = build_schedule(kind, devices=p, microbatches=m, costs=costs, **kwargs)
    return schedule, simulate(schedule, costs.for_placement(schedule.placement),
                              memory=kwargs.get("memory"))


@pytest.mark.parametrize("kind", V_KINDS)
def test_placement_is_a_v(kind):
    schedule, _ = _run(kind, 3, 4, Costs.uniform(3))
    assert schedule.placement == Placement.vshape(3)
    assert schedule.placement.stages_on(0) == (0, 5)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("m", [1, 2, 5, 16])
@pytest.mark.parametrize("kind", V_KINDS)
def test_peak_memory_within_cap(kind, p, m):
    _, result = _run(kind, p, m, Costs.uniform(p))
    assert max(result.peak_memory) <= CAPS[kind](p) + 1e-9


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6, 8])
def test_zb_v_has_no_bubble_at_equal_costs(p):
    for m in (2 * p - 1, 3 * p):
        _, result = _run("zb-v", p, m, Costs.uniform(p))
        assert max(result.device_span) == pytest.approx(3 * m, abs=1e-9)
        assert max(result.peak_memory) <= p


# (kind, p, m, bubble rate the paper's formula gives: V-Half ~ p/2m, V-Min ~ 2p/3m)
PUBLISHED = [
    ("v-half", 4, 16, 4 / 32),
    ("v-half", 8, 16, 8 / 32),
    ("v-min", 4, 16, 8 / 48),
    ("v-min", 8, 16, 16 / 48),
]


@pytest.mark.parametrize(("kind", "p", "m", "bound"), PUBLISHED)
def test_controllable_memory_bubbles_within_published(kind, p, m, bound):
    _, result = _run(kind, p, m, Costs.uniform(p))
    assert result.bubble_rate <= bound


@st.composite
def problems(draw):
    p = draw(st.integers(1, 6))
    costs = Costs(**draw_shares(draw, p), comm=draw(st.floats(0, 1)))
    limit = draw(st.none() | st.floats(1.0, 2.0 * p))
    return p, draw(st.integers(1, 16)), costs, limit


@pytest.mark.parametrize("kind", V_KINDS)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=problems())
def test_v_schedules_valid_within_cap_and_limit(kind, problem):
    p, m, costs, limit = problem
    # build_schedule validates: every op once, on its device, no deadlock, within the limit.
    _, result = _run(kind, p, m, costs, memory_limit=limit)
    cap = CAPS[kind](p) if limit is None else min(CAPS[kind](p), limit)
    assert max(result.peak_memory) <= cap + 1e-9


@pytest.mark.parametrize("kind", V_KINDS)
def test_limit_below_one_microbatch_is_refused(kind):
    with pytest.raises(ValueError, match="one microbatch alone needs 1 on a device"):
        build_schedule(kind, devices=4, microbatches=8, costs=Costs.uniform(4), memory_limit=0.9)


# [Note: bubble-filling V]: on uneven costs and comm, ZB-V is never worse than the Zero Bubble
# repository's own V scheduler (its figures: tests/planner/paper.py), at the same memory p.
@pytest.mark.parametrize(("row", "figure"), list(zip(TABLE5, ZBV_REPOSITORY_TABLE5)),
                         ids=TABLE5_IDS)
def test_zb_v_on_the_papers_profiles_is_at_most_the_zb_repositorys(row, figure):
    _, p, m, f, b, w, comm = row[:7]
    _, result = _run("zb-v", p, m, Costs.uniform(p, F=f, B=b, W=w, comm=comm))
    assert result.bubble_rate <= figure + 5e-5  # the figures are rounded to 4 digits
    assert max(result.peak_memory) <= p + 1e-9


@pytest.mark.parametrize(("p", "m", "figure"), ZBV_REPOSITORY_TESTS)
def test_zb_v_on_the_zb_repositorys_test_settings_is_at_most_its_figure(p, m, figure):
    memory = MemoryModel.from_dims(seq=4096, micro_batch=1, hidden=4096, heads=8)
    costs = Costs.uniform(p, F=2000.0, B=2000.0, W=2000.0, comm=10.0)
    _, result = _run("zb-v", p, m, costs, memory=memory)
    assert result.bubble_rate <= figure + 5e-5
    assert max(result.peak_memory) <= p + 1e-9


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=problems(), fill_f=st.booleans(), fill_b=st.booleans())
def test_a_bubble_filling_v_is_valid_within_its_cap_or_none(problem, fill_f, fill_b):
    p, m, costs, _ = problem
    placement = Placement.vshape(p)
    prob = Problem(placement=placement, costs=costs.for_placement(placement),
                   memory=MemoryModel(), microbatches=m)
    orders = fill_v_orders(prob, p * prob.footprint, fill_f=fill_f, fill_b=fill_b)
    if orders is None:
        return
    schedule = to_schedule("fill", prob, orders)
    validate(schedule, costs.for_placement(placement), memory_limit=p * prob.footprint)
