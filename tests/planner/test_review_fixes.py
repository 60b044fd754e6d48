"""Edge cases of the planner: non-finite inputs, interleaving with one chunk, unsatisfiable memory
limits, ties in `auto`, float noise in the bubble rate, and the Table 1 memory and cost model."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowkit.planner import Costs, MemoryModel, ScheduleError, simulate
from flowkit.planner.dims import layer_flops, layer_memory
from flowkit.planner.schedules import build_schedule
from flowkit.planner.schedules.greedy import Score


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_costs_and_memory_refuse_non_finite_numbers(bad):
    with pytest.raises(ValueError, match="finite"):
        Costs(F=[1, bad], B=[1, 1], W=[1, 1])
    with pytest.raises(ValueError, match="finite"):
        Costs.uniform(2, comm=bad)
    with pytest.raises(ValueError, match="finite"):
        MemoryModel(B=bad)


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


@pytest.mark.parametrize(
    ("memory", "limit", "reason"),
    [
        (MemoryModel(), 0.5, "one microbatch alone needs 1"),
        (MemoryModel(B=0, W=0, BW=0), 2, "ops never free memory, so 8 microbatches need 8×1 = 8"),
        (MemoryModel(B=0.25, W=0, BW=0.25), 7, "ops never free memory"),
        (MemoryModel(B=-0.25, W=-0.25, BW=-0.5), 4.4, "at least 7×0.5 + 1 = 4.5 on a device"),
    ],
)
@pytest.mark.parametrize("chunks", [1, 2])
def test_auto_under_an_unsatisfiable_limit_says_why(memory, limit, reason, chunks):
    with pytest.raises(ScheduleError, match="no schedule fits memory_limit=") as raised:
        build_schedule("auto", devices=4, microbatches=8, costs=Costs.uniform(4),
                       memory=memory, memory_limit=limit, chunks=chunks)
    assert raised.value.over_memory and reason in str(raised.value)


@pytest.mark.parametrize("chunks", [1, 2])
def test_auto_meets_the_least_feasible_limit_when_backward_frees_part(chunks):
    memory = MemoryModel(B=-0.25, W=-0.25, BW=-0.5)
    sched = build_schedule("auto", devices=4, microbatches=8, costs=Costs.uniform(4),
                           memory=memory, memory_limit=4.5, chunks=chunks)
    result = simulate(sched, Costs.uniform(4).for_placement(sched.placement), memory)
    assert max(result.peak_memory) <= 4.5 + 1e-9


def test_validate_marks_a_memory_only_failure():
    with pytest.raises(ScheduleError) as raised:
        build_schedule("gpipe", devices=4, microbatches=8, costs=Costs.uniform(4), memory_limit=4)
    assert raised.value.over_memory
    with pytest.raises(ScheduleError) as raised:
        build_schedule("zb-v", devices=4, microbatches=8, costs=Costs.uniform(4),
                       memory=MemoryModel(B=0, W=0, BW=0))
    assert raised.value.over_memory


def test_auto_breaks_time_ties_on_memory():
    costs = Costs.uniform(4, F=0, B=0, W=0)
    sched = build_schedule("auto", devices=4, microbatches=8, costs=costs)
    assert max(simulate(sched, costs).peak_memory) == 4  # not gpipe-like 8 for the same time


def test_score_compares_time_before_memory():
    assert Score(1.0, 2.0, peak=9).better_than(Score(1.0, 2.5, peak=1))
    assert Score(1.0, 2.0, peak=4).better_than(Score(1.0, 2.0, peak=8))
    assert not Score(1.0, 2.0, peak=4).better_than(Score(1.0, 2.0, peak=4))
    assert not Score(1.1, 1.0, peak=1).better_than(Score(1.0, 2.0, peak=8))


def test_bubble_rate_is_never_negative_from_float_noise():
    costs = Costs.uniform(2, F=0.1, B=0.1, W=0.1)
    sched = build_schedule("zb-v", devices=2, microbatches=5, costs=costs)
    result = simulate(sched, costs.for_placement(sched.placement))
    assert max(result.busy) > max(result.device_span)  # the noise this guards against
    assert result.bubble_rate == 0.0 and math.copysign(1, result.bubble_rate) == 1


def test_table1_formulas():
    s, b, h, a = 1024, 1, 2304, 24
    assert layer_flops(seq=s, micro_batch=b, hidden=h) == (
        s * b * h * (24 * h + 4 * s), s * b * h * (24 * h + 8 * s), s * b * h * 24 * h)
    assert layer_memory(seq=s, micro_batch=b, hidden=h, heads=a) == (
        s * b * (34 * h + 5 * a * s), 32 * s * b * h)
    with pytest.raises(ValueError, match="heads must be a positive integer"):
        layer_memory(seq=s, micro_batch=b, hidden=h, heads=0)


def test_memory_model_from_dims_splits_a_unit_between_b_and_w():
    memory = MemoryModel.from_dims(seq=1024, micro_batch=1, hidden=2304, heads=24)
    kept = 32 * 2304 / (34 * 2304 + 5 * 24 * 1024)  # M_W / M_B
    assert memory.F == 1 and memory.BW == -1
    assert memory.W == pytest.approx(-kept) and memory.B == pytest.approx(kept - 1)
    # microbatch size cancels out of the ratio
    four = MemoryModel.from_dims(seq=1024, micro_batch=4, hidden=2304, heads=24)
    assert four.W == pytest.approx(memory.W)


def test_costs_from_dims_scale_with_layers_and_throughput():
    costs = Costs.from_dims(layers_per_stage=[2, 2, 3], seq=1024, micro_batch=1, hidden=2304,
                            flops_per_s=1e12, comm=0.5)
    f, b, w = layer_flops(seq=1024, micro_batch=1, hidden=2304)
    assert costs.F == pytest.approx((2 * f / 1e12, 2 * f / 1e12, 3 * f / 1e12))
    assert costs.B[2] == pytest.approx(3 * b / 1e12) and costs.W[0] == pytest.approx(2 * w / 1e12)
    assert costs.comm == 0.5
    with pytest.raises(ValueError, match="flops_per_s"):
        Costs.from_dims(layers_per_stage=[1], seq=1, micro_batch=1, hidden=1, flops_per_s=0)
