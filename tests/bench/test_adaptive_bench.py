"""`flowkit bench adaptive` at tiny settings: a short warm-up, then both sides per seed until
each has generated its token budget; the figures are the runs' own (behaviour, not timings)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from benchmarks.adaptive import AdaptiveBench, run_adaptive_bench
from flowkit.cli import main


@pytest.mark.slow
def test_both_sides_spend_the_same_token_budget_and_report_their_figures():
    bench = AdaptiveBench(seeds=1, warm_steps=2, token_budget=300, prompts=4, n=4, pool=8,
                          target=0.0, window=1)
    figures = run_adaptive_bench(bench)
    (run,) = figures["runs"]
    for side in ("fixed", "adaptive"):
        got = run[side]
        assert got["tokens_curve"][-2] < 300 <= got["tokens"]  # it stopped once spent
        assert got["tokens_curve"][-1] == got["tokens"] and got["steps"] >= 2
        assert got["tokens_to_target"] == got["tokens_curve"][0]  # a target of 0: step one
        assert 0 <= got["zero_advantage_share"] <= 1
        assert 0 <= got["zero_advantage_tokens_share"] <= 1
        gain = got["tokens_per_reward_gain"]  # tokens over the smoothed reward's gain
        assert gain is None or gain > 0
        assert figures[side]["tokens_per_reward_gain_median"] == gain
    assert figures["ratio"] == run["adaptive"]["tokens_curve"][0] / run["fixed"]["tokens_curve"][0]
    assert figures["warm_up"]["steps"] == 2 and "weights" not in figures["warm_up"]


@pytest.mark.parametrize(("args", "named"), [
    (["--seeds", "0"], "--seeds"),
    (["--branch-entropy", "0.5"], "--branch-entropy is for the tree side: add --tree"),
    (["--tree", "--branch-entropy", "-1"], "--branch-entropy"),
    (["--adaptive"], "--adaptive spreads the tree side's roots: add --tree"),
    (["--tree", "--second-round", "4"], "--second-round samples the adaptive side again"),
    (["--second-round-budget", "8"], "--second-round-budget and --second-round-when shape"),
    (["--second-round-when", "fail"], "--second-round-budget and --second-round-when shape"),
    (["--second-round", "2", "--second-round-when", "hard"], "--second-round-when"),
    (["--second-round", "-1"], "--second-round"),
])
def test_the_bench_command_refuses_a_bad_setting_before_it_starts(args, named):
    result = CliRunner().invoke(main, ["bench", "adaptive", *args])
    assert result.exit_code == 2 and named in result.output


@pytest.mark.slow
def test_the_second_round_side_counts_the_tokens_of_both_rounds():
    bench = AdaptiveBench(seeds=1, warm_steps=2, token_budget=300, prompts=4, n=4, pool=8,
                          target=0.0, window=1, n_min=2, n_max=2, second_round=2)
    figures = run_adaptive_bench(bench)
    (run,) = figures["runs"]
    got = run["adaptive"]
    assert got["tokens_curve"][-2] < 300 <= got["tokens"] and got["steps"] >= 2
    assert figures["setup"]["second_round"] == 2
    assert got["second_round_samples"] > 0 and run["fixed"]["second_round_samples"] == 0


@pytest.mark.slow
def test_the_tree_side_spends_the_same_token_budget_counting_shared_prefixes_once():
    bench = AdaptiveBench(seeds=1, warm_steps=2, token_budget=300, prompts=4, n=4, pool=8,
                          target=0.0, window=1, tree=True, branch_at=(1, 2), branches=2)
    figures = run_adaptive_bench(bench)
    (run,) = figures["runs"]
    assert set(run) == {"seed", "fixed", "tree"} and bench.tree_roots == 1
    got = run["tree"]
    assert got["tokens_curve"][-2] < 300 <= got["tokens"] and got["steps"] >= 2
    assert figures["ratio"] == got["tokens_curve"][0] / run["fixed"]["tokens_curve"][0]


@pytest.mark.slow
def test_the_adaptive_tree_side_spreads_its_roots_within_the_budget():
    bench = AdaptiveBench(seeds=1, warm_steps=2, token_budget=300, prompts=4, n=8, pool=8,
                          target=0.0, window=1, tree=True, branch_at=(1, 2), branches=2,
                          adaptive_tree=True, n_min=1, n_max=3)
    figures = run_adaptive_bench(bench)
    (run,) = figures["runs"]
    assert set(run) == {"seed", "fixed", "adaptive_tree"} and bench.tree_roots == 2
    got = run["adaptive_tree"]
    assert got["tokens_curve"][-2] < 300 <= got["tokens"] and got["steps"] >= 2
    assert figures["ratio"] == got["tokens_curve"][0] / run["fixed"]["tokens_curve"][0]
