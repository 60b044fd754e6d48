"""`flowkit bench rl` on a tiny workload: the figures it promises, measured side by side."""

from flowkit.bench.rl import RLSetup, run_rl_bench


def test_the_rl_bench_reports_fused_and_barrier_step_times_per_algorithm():
    setup = RLSetup(prompts=4, n=2, max_new_tokens=32, rollout_executors=2, microbatches=2,
                    steps=2, token=0.0002, F=0.002, B=0.002, W=0.001)
    figures = run_rl_bench(setup, torch_steps=0)
    assert figures["setup"]["prompts"] == 4
    for algo in ("grpo", "ppo"):
        result = figures[algo]
        assert result["fused_step_s"] > 0 and result["barrier_step_s"] > 0
        assert result["speedup"] == result["barrier_step_s"] / result["fused_step_s"]
