"""`flowkit bench scale` at a small size: fused and barrier steps of the same GRPO flow on the
same simulator executors, and the per-sample figures; sizes it cannot run are usage errors."""

from __future__ import annotations

from click.testing import CliRunner

from benchmarks.scale import run_scale_bench
from flowkit.cli import main


def test_the_scale_bench_reports_both_modes_per_size():
    figures = run_scale_bench(samples=(32, 64), steps=2)
    for size in ("32", "64"):
        for mode in ("fused", "barrier"):
            row = figures[size][mode]
            assert row["step_s"] > row["model_s"] > 0
            assert row["engine_us_per_sample"] > 0 and row["ops_per_s"] > 0
            assert row["messages_per_sample"] > 0 and row["controller_cpu_us_per_sample"] > 0
            assert 0 < row["generation_s"] < row["step_s"]
            assert row["first_downstream_s"] >= 0 or mode == "fused"  # fused: may overlap
        assert figures[size]["lower_bound"]["step_s"] > 0
        assert figures[size]["fused_over_barrier"] > 0
        assert figures[size]["fused_over_lower_bound"] > 0


def test_a_size_that_is_no_multiple_of_8_is_a_usage_error():
    result = CliRunner().invoke(main, ["bench", "scale", "--samples", "100"])
    assert result.exit_code == 2 and "multiple of 8" in result.output
