"""`flowkit bench eval`: each mode's runs with and without the evaluation are measured side by
side on the same executors (behaviour, not timings)."""

from __future__ import annotations

import pytest

from benchmarks.evaluation import run_eval_bench


@pytest.mark.slow
def test_the_eval_bench_measures_both_modes_with_and_without():
    figures = run_eval_bench(steps=3, rounds=1, every=1, eval_prompts=8)
    for mode in ("sync", "async"):
        runs = figures[mode]
        assert runs["steps_per_s_with"] > 0 and runs["steps_per_s_without"] > 0
        assert runs["ratio"] == runs["steps_per_s_with"] / runs["steps_per_s_without"]
    assert (figures["eval_every"], figures["eval_prompts"]) == (1, 8)
