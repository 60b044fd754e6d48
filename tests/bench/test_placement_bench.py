"""`flowkit bench placement` on a tiny workload: each placement's run, its executors' tags and
idle shares, and the ratios the bench promises (behaviour, not timings)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from benchmarks.placement import PLACEMENT_MODES, PlacementSetup, _covered, run_placement_bench
from flowkit.cli import main

TINY = PlacementSetup(prompts=4, n=2, max_new_tokens=16, microbatches=2, steps=2,
                      token=0.0005, token_per_seq=0.0001, F=0.002, B=0.002, W=0.001)


@pytest.mark.slow
def test_each_placement_runs_on_its_tags_and_reports_its_idle_shares():
    figures = run_placement_bench(TINY)
    assert figures["baseline"] == "disaggregated" and figures["allowed_speedup"] > 0
    for placement in PLACEMENT_MODES:
        run = figures[placement]
        assert run["steps_per_s"] > 0 and 0 <= run["train_idle_share"] <= 1
        assert 0 < run["busy_share"] <= 1
    assert figures["disaggregated"]["tags"] == [["train"]] * 2 + [["rollout"]] * 2
    assert figures["multiplexed"]["tags"][:2] == [["rollout", "train"]] * 2
    assert figures["colocated"]["other_idle_share"] is None  # every executor trains
    assert figures["disaggregated"]["speedup"] == 1.0
    assert figures["bound"]["tags"] == [["train"]] * 2 + [["rollout"]] * 4
    assert figures["allowed_speedup"] == figures["bound"]["speedup"]


def test_the_union_of_spans_counts_overlaps_once():
    assert _covered([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4
    assert _covered([]) == 0


def test_unknown_placements_and_too_few_steps_are_refused():
    with pytest.raises(ValueError, match="unknown placements"):
        run_placement_bench(TINY, placements=("spread",))
    result = CliRunner().invoke(main, ["bench", "placement", "--steps", "1"])
    assert result.exit_code == 2 and "--steps" in result.output
