"""The inference bench times both budgets on both batchings and returns their ratios."""

import json

import pytest

from benchmarks.infer import ARRIVALS, run_infer_bench


def test_the_infer_bench_times_both_budgets_on_both_batchings():
    result = run_infer_bench(repeats=1)
    assert json.loads(json.dumps(result)) == result
    assert result["rollouts"] == sum(ARRIVALS)
    for key in ("arrivals_256", "arrivals_4096", "all_at_once_256", "all_at_once_4096"):
        assert result[f"{key}_ms"] > 0
    assert result["arrivals_256_over_4096"] == (result["arrivals_256_ms"]
                                                / result["arrivals_4096_ms"])


def test_the_infer_bench_refuses_no_repeats():
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        run_infer_bench(repeats=0)
