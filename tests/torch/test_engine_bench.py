"""`flowkit bench rollout`'s torch part runs and reports its figures (their values are the
machine's: the README says what they were)."""

from benchmarks.engine import engine_figures


def test_the_engine_bench_reports_both_sides_on_the_same_tokens():
    figures = engine_figures(repeats=1)["rollout_engine"]
    assert set(figures) == {"16x8_8tok", "32x8_20tok"}
    for case in figures.values():
        assert case["tokens"] > 0 and case["speedup"] > 0
        assert case["engine_tokens_per_s"] > 0 and case["per_prompt_tokens_per_s"] > 0


def test_the_engines_bench_measures_each_engine_on_one_model():
    """`flowkit bench rollout --engine ...`, flowkit's engine alone (vLLM's start is the vLLM
    tests' to pay)."""
    import pytest

    pytest.importorskip("transformers", reason="the hf extra: pip install 'flowkit[hf]'")
    from benchmarks.rollout_engines import engines_figures

    size = {"prompts": 2, "n": 2, "prompt_len": 4, "max_new_tokens": 3}
    figures = engines_figures(("flowkit",), repeats=1, size=size)["rollout_engines"]
    assert figures["flowkit"]["tokens"] == 12
    assert figures["flowkit"]["tokens_per_s"] > 0 and figures["flowkit"]["weight_sync_s"] > 0
    with pytest.raises(ValueError, match="unknown engine"):
        engines_figures(("sglang",))
