"""`flowkit bench launch` without Ray: fresh processes against the fork server's children,
cold and warm, side by side (the Ray figures: tests/cli/test_ray_launch.py)."""

from benchmarks.launch import run_launch_bench


def test_the_launch_bench_times_fresh_and_forked_executors_side_by_side():
    figures = run_launch_bench(executors=1, rounds=1, kind="sim", ray=False)
    for way in ("fresh", "forked_cold", "forked_warm"):
        assert figures[f"{way}_start_s"] > 0 and figures[f"{way}_replace_s"] > 0
    assert figures["forked_warm_start_ratio"] == (figures["forked_warm_start_s"]
                                                  / figures["fresh_start_s"])
    assert "ray_start_s" not in figures and figures["ray_init_s"] is None
