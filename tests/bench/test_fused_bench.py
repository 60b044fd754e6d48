"""`flowkit bench fused` on a tiny workload: the planner's figures, each way's measured run on
simulator executors, and what the bench promises of them (behaviour, not timings)."""

from __future__ import annotations

import pytest

from benchmarks.fused import WAYS, FusedSetup, run_fused_bench

TINY = FusedSetup(microbatches=4, kinds=("1f1b",), op_s=0.002, prompts=8, steps=2,
                  torch=False)


def test_the_planner_fuses_below_one_after_the_other_and_each_way_runs():
    figures = run_fused_bench(TINY)
    planned = figures["planner"]["1f1b"]  # 4 devices, 4 microbatches, unit costs
    assert planned["in turn"]["makespan"] == 2 * planned["alone"]["makespan"] == 42.0
    assert planned["fused other way"]["makespan"] < planned["fused same way"]["makespan"] < 42
    assert planned["fused other way, limit 4"]["peak_memory"] <= 4.0
    measured = figures["simulator"]["1f1b"]
    for way in WAYS:
        for suffix in ("", ", limit 4"):
            run = measured[way + suffix]
            assert run["pipeline_makespan_s"] > 0 and 0 <= run["bubble_rate"] < 1
    # the memory limit binds what the executors hold where the plan is fused or in turn
    assert measured["fused, limit 4"]["peak_activation"] <= 4.0
    assert measured["in turn"]["peak_activation"] <= 4.0
    assert measured["fused"]["predicted"]["makespan"] < \
        measured["fused"]["predicted"]["separate_makespan"]
    assert measured["lanes"]["predicted"] is None and "torch" not in figures


def test_too_few_steps_are_refused():
    with pytest.raises(ValueError, match="needs >= 2, got 1"):
        run_fused_bench(FusedSetup(steps=1))
