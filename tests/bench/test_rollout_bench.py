"""`flowkit bench rollout` on a tiny workload: the figures it promises, and its bound."""

import pytest

from benchmarks.rollout import RolloutSetup, lower_bound_s, run_rollout_bench
from flowkit.planner.simcosts import SimCosts

_FIGURES = {"makespan_s", "lower_bound_s", "makespan_over_bound", "first_downstream_s",
            "first_downstream_over_makespan", "longest", "samples", "length_rank_corr",
            "work_imbalance"}


def test_the_rollout_bench_reports_makespan_bound_and_first_sample_per_dispatch():
    setup = RolloutSetup(prompts=4, n=2, max_new_tokens=32, prompt_tokens=16, steps=2,
                         token=0.0005)
    figures = run_rollout_bench(setup, parts=("sim",))  # torch: tests/torch/test_engine_bench
    assert figures["setup"]["prompts"] == 4
    for dispatch in ("length_aware", "count_based"):
        result = figures["sim"][dispatch]
        assert set(result) == _FIGURES
        assert result["samples"] == 8 and result["makespan_s"] > 0 < result["lower_bound_s"]
        assert result["makespan_over_bound"] == result["makespan_s"] / result["lower_bound_s"]
        # when the first sample's downstream op starts is a timing: on a loaded machine it can
        # come after the simulated generation's end; the figure is its share of the makespan
        assert result["first_downstream_s"] > 0
        assert result["first_downstream_over_makespan"] == \
            result["first_downstream_s"] / result["makespan_s"]
    with pytest.raises(ValueError, match="unknown rollout bench part 'gpu'; parts: sim, torch"):
        run_rollout_bench(setup, parts=("gpu",))


def test_the_bound_is_the_longest_sample_at_the_thinning_batch_or_the_token_throughput():
    costs = SimCosts(token=1.0, token_per_seq=0.1, prefill_token=0.0, max_batch=4)
    # two executors: 2, 2, then 1 sample each while 4, 3, then 2 of them decode
    assert lower_bound_s([1, 2, 3, 3], [], executors=2, costs=costs) == pytest.approx(
        1.2 + 1.2 + 1.1)
    # 8 samples of 10 tokens on one executor of 4 slots: 80 tokens at 4 an iteration of 1.4
    assert lower_bound_s([10] * 8, [], executors=1, costs=costs) == pytest.approx(20 * 1.4)
