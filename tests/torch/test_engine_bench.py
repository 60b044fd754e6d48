"""`flowkit bench rollout`'s torch part runs and reports its figures (their values are the
machine's: the README says what they were)."""

from benchmarks.engine import engine_figures


def test_the_engine_bench_reports_both_sides_on_the_same_tokens():
    figures = engine_figures(repeats=1)["rollout_engine"]
    assert set(figures) == {"16x8_8tok", "32x8_20tok"}
    for case in figures.values():
        assert case["tokens"] > 0 and case["speedup"] > 0
        assert case["engine_tokens_per_s"] > 0 and case["per_prompt_tokens_per_s"] > 0
