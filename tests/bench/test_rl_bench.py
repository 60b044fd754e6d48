"""`flowkit bench rl` on a tiny workload: the figures it promises, per mode, measured side by
side over the same steps."""

import pytest

from benchmarks.rl import MODES, RLSetup, run_rl_bench

TINY = RLSetup(prompts=4, n=2, max_new_tokens=32, rollout_executors=2, microbatches=2,
               steps=3, token=0.0002, F=0.002, B=0.002, W=0.001)


@pytest.mark.slow
def test_the_rl_bench_reports_each_modes_throughput_and_their_ratios():
    figures = run_rl_bench(TINY, torch_steps=0, max_staleness=1)
    assert figures["setup"]["prompts"] == 4
    assert figures["modes"] == list(MODES) and figures["max_staleness"] == 1
    assert figures["samples_per_step"] == 8 and figures["measured_steps"] == 2
    for algo in ("grpo", "ppo"):
        result = figures[algo]
        for mode in MODES:
            run = result[mode]
            assert run["steps_per_s"] > 0 and run["steady_steps_per_s"] > 0
            assert run["step_s"] == pytest.approx(1 / run["steps_per_s"])
        assert result["barrier"]["staleness_max"] == result["fused"]["staleness_max"] == 0
        assert 0 <= result["async"]["staleness_mean"] <= result["async"]["staleness_max"] <= 1
        assert "generation_share" not in result["async"]  # steps overlap: no such share
        assert set(result["speedup"]) == {f"{later}/{earlier}" for i, later in enumerate(MODES)
                                          for earlier in MODES[:i]}
        for mode in ("multiplexed", "colocated"):  # asynchronous, on executors lent out
            assert 0 <= result[mode]["staleness_mean"] <= result[mode]["staleness_max"] <= 1
        assert result["partial"]["staleness_max"] <= 1
        assert result["partial"]["carried_over_mean"] > 0  # 6 prompts generate, 4 train
        assert result["speedup"]["async/fused"] == (result["async"]["steps_per_s"]
                                                    / result["fused"]["steps_per_s"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_the_rl_bench_runs_one_mode_alone(mode):
    figures = run_rl_bench(TINY, modes=(mode,), torch_steps=0, max_staleness=2)
    for algo in ("grpo", "ppo"):
        assert list(figures[algo]) == [mode, "speedup", "steady_speedup"]
        assert figures[algo]["speedup"] == {}
        assert figures[algo][mode]["steps_per_s"] > 0
        synchronous = mode in ("barrier", "fused")
        assert figures[algo][mode]["staleness_max"] <= (0 if synchronous else 2)


def test_the_rl_bench_refuses_unknown_modes_and_too_few_steps():
    with pytest.raises(ValueError, match="unknown bench modes"):
        run_rl_bench(TINY, modes=("overlapped",), torch_steps=0)
    with pytest.raises(ValueError, match="needs >= 2"):
        run_rl_bench(RLSetup(steps=1), modes=("fused",), torch_steps=0)


def test_the_placements_lend_the_train_executors_or_every_executor():
    setup = RLSetup(rollout_executors=2, train_executors=1)
    assert setup.tags("disaggregated") == [("rollout",), ("rollout",), ("train",)]
    assert setup.tags("multiplexed") == [("rollout",), ("rollout",), ("rollout", "train")]
    assert setup.tags("colocated") == [("rollout", "train")] * 3


def test_the_train_scale_scales_the_training_sides_costs_and_not_generations():
    # by default a quarter: generation is most of a step, as RL systems report
    assert RLSetup().sim_costs() == RLSetup(train_scale=0.25).sim_costs()
    costs, scaled = RLSetup(train_scale=1).sim_costs(), RLSetup(train_scale=0.25).sim_costs()
    for name in ("F", "B", "W", "optimizer_step", "infer_token"):
        assert getattr(scaled, name) == pytest.approx(getattr(costs, name) / 4)
    assert (scaled.token, scaled.length_sigma) == (costs.token, costs.length_sigma)


def test_the_cli_refuses_a_train_scale_that_is_not_positive():
    from click.testing import CliRunner

    from flowkit.cli import main

    result = CliRunner().invoke(main, ["bench", "rl", "--train-scale", "0"])
    assert result.exit_code == 2 and "--train-scale" in result.output
