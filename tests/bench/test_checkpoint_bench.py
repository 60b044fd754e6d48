"""The asynchronous part of `flowkit bench checkpoint`: both runs train every step within the
bound, and the figures say what they measured (behaviour, not timings)."""

from __future__ import annotations

import pytest

from benchmarks.checkpoint import run_async_checkpoint_bench, run_async_torch_checkpoint_bench


def test_async_checkpoint_bench_measures_both_runs_within_the_bound():
    figures = run_async_checkpoint_bench(steps=3, rounds=1, max_staleness=1, prompts=4,
                                         rollout_executors=2)
    assert figures["steps_per_s_with"] > 0 and figures["steps_per_s_without"] > 0
    assert figures["ratio"] == figures["steps_per_s_with"] / figures["steps_per_s_without"]
    assert 0 < figures["checkpoint_s"] and figures["staleness_max"] <= 1
    assert figures["samples_per_step"] == 4 * 8


def test_too_few_steps_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="needs >= 2"):
        run_async_torch_checkpoint_bench(steps=1)
