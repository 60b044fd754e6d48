"""`flowkit bench fill` on a small workload: each way runs, the reference scores where the way
says, and the held-back time is measured (behaviour, not timings)."""

from __future__ import annotations

import pytest

from benchmarks.fill import WAYS, FillSetup, run_fill_bench

SMALL = FillSetup(steps=3, prompts=16)


def test_each_way_scores_where_it_says():
    figures = run_fill_bench(SMALL)
    assert figures["on trainers"]["scored_on_trainers"] == 16 * 8  # every sample
    assert figures["apart"]["scored_on_trainers"] == 0
    assert figures["filled"]["scored_on_trainers"] > 0  # in bubbles, after the first step
    for way in WAYS:
        assert figures[way]["step_s"] > 0 and figures[way]["held_back_ms"] >= 0
    assert figures["filled_over_apart"] > 0


def test_too_few_steps_are_refused():
    with pytest.raises(ValueError, match="needs >= 2, got 1"):
        run_fill_bench(FillSetup(steps=1))
