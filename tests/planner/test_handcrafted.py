"""Handcrafted schedules reach the bubble and memory formulas of the Zero Bubble paper (Qi, Wan,
Huang, Lin: "Zero Bubble Pipeline Parallelism", ICLR 2024); interleaved 1F1B keeps Megatron's.

Bubble here is the busiest stage's idle time: max span - m(F+B+W) with equal costs per stage (the
paper's "bubble size"). Preconditions, found by sweeping random costs: 1F1B's formula
holds for any F, B, W; ZB-H1's and ZB-H2's need W <= F and W <= B (so that a W fits in the
holes it is meant to fill), and ZB-H2's needs m >= 2p-1 to fill its warm-up.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowkit.planner import Costs, simulate
from flowkit.planner.schedules import build_schedule


def _bubble_and_peak(kind, p, m, F, B, W):
    costs = Costs.uniform(p, F=F, B=B, W=W)
    result = simulate(build_schedule(kind, devices=p, microbatches=m, costs=costs), costs)
    return max(result.device_span) - m * (F + B + W), max(result.peak_memory)


FORMULAS = {
    # kind: (bubble(p, F, B, W), peak memory(p), smallest m for which both hold)
    "1f1b": (lambda p, F, B, W: (p - 1) * (F + B + W), lambda p: p, lambda p: p),
    "zb-h1": (lambda p, F, B, W: (p - 1) * (F + B - W), lambda p: p, lambda p: p),
    "zb-h2": (lambda p, F, B, W: max(0.0, (p - 1) * (F + B - 2 * W)), lambda p: 2 * p - 1,
              lambda p: 2 * p - 1),
}

# (p, m): one stage, the smallest m each formula allows, and a few larger pipelines.
TABLE = [(1, 1), (1, 4), (2, 2), (2, 3), (2, 7), (3, 3), (3, 5), (3, 9), (4, 4), (4, 7), (4, 8),
         (4, 13), (5, 9), (6, 11), (8, 8), (8, 15), (8, 24)]


# Only the (kind, p, m) the formula covers: zb-h2 needs m >= 2p-1 to fill its warm-up.
CASES = [(kind, p, m) for kind in sorted(FORMULAS) for p, m in TABLE if m >= FORMULAS[kind][2](p)]


@pytest.mark.parametrize(("kind", "p", "m"), CASES)
@pytest.mark.parametrize(("F", "B", "W"), [(1, 1, 1), (2, 2, 1), (3, 2, 1)])
def test_formula_table(kind, p, m, F, B, W):
    bubble, peak, _ = FORMULAS[kind]
    got_bubble, got_peak = _bubble_and_peak(kind, p, m, F, B, W)
    assert got_bubble == pytest.approx(bubble(p, F, B, W), abs=1e-9)
    assert got_peak == peak(p)


positive = st.floats(0.1, 10.0, allow_nan=False)


@st.composite
def split_costs(draw):
    """F, B, W with W <= min(F, B), the zero-bubble formulas' precondition."""
    F, B = draw(positive), draw(positive)
    return F, B, draw(st.floats(0.05, min(F, B)))


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 8), extra=st.integers(0, 12), costs=st.tuples(positive, positive, positive))
def test_1f1b_formula_any_costs(p, extra, costs):
    got, peak = _bubble_and_peak("1f1b", p, p + extra, *costs)
    assert got == pytest.approx(FORMULAS["1f1b"][0](p, *costs), rel=1e-9, abs=1e-9)
    assert peak == p


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["zb-h1", "zb-h2"]), p=st.integers(1, 8), extra=st.integers(0, 12),
       costs=split_costs())
def test_zero_bubble_formulas_where_w_fits(kind, p, extra, costs):
    bubble, peak, min_m = FORMULAS[kind]
    got, got_peak = _bubble_and_peak(kind, p, min_m(p) + extra, *costs)
    assert got == pytest.approx(bubble(p, *costs), rel=1e-9, abs=1e-9)
    assert got_peak == peak(p)


def test_gpipe_holds_every_microbatch():
    _, peak = _bubble_and_peak("gpipe", 4, 6, 1, 1, 1)
    assert peak == 6


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 8, 4), (3, 9, 3)])
def test_interleaved_beats_1f1b_at_equal_costs(p, m, v):
    costs = Costs.uniform(p)
    plain = simulate(build_schedule("1f1b", devices=p, microbatches=m, costs=costs), costs)
    sched = build_schedule("interleaved-1f1b", devices=p, microbatches=m, costs=costs, chunks=v)
    chunked = simulate(sched, costs.for_placement(sched.placement))
    # Megatron's bubble: (p-1)/v of 1F1B's, with the fused backward.
    assert max(chunked.device_span) - m * 3 == pytest.approx((p - 1) * 3 / v)
    assert chunked.makespan < plain.makespan


@given(p=st.integers(1, 8), m=st.integers(1, 24))
def test_interleaved_with_one_chunk_is_1f1b(p, m):
    costs = Costs.uniform(p)
    plain = build_schedule("1f1b", devices=p, microbatches=m, costs=costs)
    one = build_schedule("interleaved-1f1b", devices=p, microbatches=m, costs=costs, chunks=1)
    assert one.device_ops == plain.device_ops
    assert max(simulate(one, costs).peak_memory) == min(p, m)


def test_interleaved_with_two_chunks_keeps_megatrons_warmup():
    costs = Costs.uniform(4)
    sched = build_schedule("interleaved-1f1b", devices=4, microbatches=8, costs=costs, chunks=2)
    first_backward = [next(i for i, a in enumerate(ops) if a.kind.value == "BW")
                      for ops in sched.device_ops]
    assert first_backward == [4 + 6 + 1, 4 + 4 + 1, 4 + 2 + 1, 4 + 0 + 1]  # (v-1)p + 2(p-1-d) + 1
