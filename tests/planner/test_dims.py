"""Table 1 of the Zero Bubble paper (Qi, Wan, Huang, Lin: "Zero Bubble Pipeline Parallelism",
ICLR 2024): a layer's FLOPs and activation memory, and the costs and memory model built on them."""

import pytest

from flowkit.planner import Costs, MemoryModel
from flowkit.planner.dims import layer_flops, layer_memory


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
