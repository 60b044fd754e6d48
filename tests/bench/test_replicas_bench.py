"""`flowkit bench train --replicas`: its planner grid and its argument errors (the CPU and
simulator parts start processes and are run by hand; docs/performance.md has their figures)."""

from __future__ import annotations

from click.testing import CliRunner

from benchmarks.cli import bench
from benchmarks.replicas import _planner_grid, run_overlap_bench


def test_the_planner_grid_scales_a_1b_model_to_8_replicas_at_100_gbps():
    grid = _planner_grid()
    for kind in ("1f1b", "zb-h1"):
        row = grid[f"{kind} P=4 100Gb/s D=8"]
        assert row["scaling_efficiency"] >= 0.9, (kind, row)
        assert 0.0 <= row["hidden"] <= 1.0
        assert grid[f"{kind} P=4 100Gb/s D=1"]["scaling_efficiency"] == 1.0
    slower = [grid[f"1f1b P=4 {gbps}Gb/s D=8"]["scaling_efficiency"]
              for gbps in ("400", "100", "25", "10")]
    assert slower == sorted(slower, reverse=True)


def test_the_overlapped_all_reduce_hides_more_under_each_schedule_in_one_command():
    """`flowkit bench train --allreduce-overlap`: D = 8, P = 4 at every link speed, the step
    overlapped never longer and more of the all-reduce hidden wherever there is any to hide."""
    result = CliRunner().invoke(bench, ["train", "--allreduce-overlap"])
    assert result.exit_code == 0, result.output
    out = run_overlap_bench()
    assert (out["replicas"], out["devices"]) == (8, 4)
    for kind in ("1f1b", "zb-h1", "zb-v"):
        for gbps in ("10", "25", "100", "400"):
            row = out[f"{kind} {gbps}Gb/s"]
            assert row["step_s_overlapped"] <= row["step_s"] + 1e-9
            assert 0.0 <= row["hidden"] < row["hidden_overlapped"] <= 1.0, (kind, gbps, row)
    assert out["zb-h1 25Gb/s"]["hidden"] == 0.0  # every ZB-H1 device ends together


def test_replica_counts_need_the_one_replica_baseline():
    result = CliRunner().invoke(bench, ["train", "--replicas", "2,4"])
    assert result.exit_code == 2
    assert "1 among them" in result.output


def test_a_simulator_cost_that_is_not_one_is_a_usage_error():
    result = CliRunner().invoke(bench, ["train", "--replicas", "1", "--sim-cost", "grad_bytes=-1"])
    assert result.exit_code == 2
    assert "grad_bytes must be a finite number of bytes >= 0" in result.output
