"""`flowkit bench train --microbatch-tokens N`: simulator replicas with per-token costs, by count
against by tokens, side by side (docs/performance.md has the full run's figures)."""

from __future__ import annotations

from click.testing import CliRunner

from benchmarks.cli import bench
from benchmarks.token_balance import BalanceSetup, run_token_balance_bench


def test_token_budget_microbatches_even_out_the_replicas_waits():
    out = run_token_balance_bench(BalanceSetup(replicas=2, batch_size=48, microbatches=6,
                                               microbatch_tokens=768, steps=3))
    count, tokens = out["by_count"], out["by_tokens"]
    assert len(count["allreduce_wait_s"]) == len(tokens["allreduce_wait_s"]) == 2
    assert count["step_s"] > 0 and tokens["step_s"] > 0
    assert out["step_by_tokens_over_by_count"] > 0


def test_a_bad_sim_cost_is_a_usage_error():
    result = CliRunner().invoke(bench, ["train", "--microbatch-tokens", "512", "--sim-cost",
                                        "F_token=fast"])
    assert result.exit_code == 2 and "F_token=fast" in result.output
