"""The agent bench runs the three ways on the same trajectories and returns their ratios."""

import json

import pytest

from benchmarks.agent import run_agent_bench


def test_the_agent_bench_runs_each_way_and_reports_the_ratios():
    result = run_agent_bench(samples=4, turns=2, latency=0.01, repeats=1)
    assert json.loads(json.dumps(result)) == result
    for way in ("overlapped", "released", "one_call_at_a_time"):
        assert result[f"{way}_s"] > 0 and result[f"{way}_prefill_tokens"] > 0
    # giving the rows up while waiting prefills the prefixes again
    assert result["released_prefill_tokens"] > result["overlapped_prefill_tokens"]
    assert result["overlapped_over_one_call_at_a_time"] == (
        result["overlapped_s"] / result["one_call_at_a_time_s"])


def test_the_agent_bench_refuses_settings_that_run_nothing():
    with pytest.raises(ValueError, match="must be >= 1"):
        run_agent_bench(repeats=0)


def test_the_program_bench_rolls_out_the_same_tokens_each_way():
    pytest.importorskip("transformers", reason="the hf extra: pip install 'flowkit[hf]'")
    pytest.importorskip("openai", reason="the agents extra: pip install 'flowkit[agents]'")
    from benchmarks.agent import run_program_bench

    result = run_program_bench(samples=3, turns=2, repeats=1)
    assert json.loads(json.dumps(result)) == result and result["same_tokens"] is True
    for way in ("environment", "program_http", "program_openai"):
        assert result[f"{way}_s"] > 0
    assert result["endpoint_ms_per_turn"] == pytest.approx(
        1e3 * (result["program_http_s"] - result["environment_s"]) / 6)
