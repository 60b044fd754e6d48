"""The split-backward bench runs on a tiny GPT and returns the figures `flowkit bench` reports."""

from __future__ import annotations

import json

import torch

from benchmarks.split_backward import run_split_backward_bench
from tests.harness import tiny_split_bench

TINY = tiny_split_bench(3)


def test_bench_times_every_stage_and_returns_the_ratios():
    threads = torch.get_num_threads()
    result = run_split_backward_bench(configs=[TINY], repeats=1, warmup=0)
    assert torch.get_num_threads() == threads  # the bench puts the thread count back
    assert json.loads(json.dumps(result)) == result
    assert result["bw_over_fused"] > 0 and result["runner_bw_over_fused"] > 0
    assert result["unsplit_over_split"] > 0
    (config,) = result["configs"]
    assert config["config"]["stages"] == 3
    assert [s["position"] for s in config["stages"]] == ["first", "middle", "last"]
    for stage in config["stages"]:
        for k in ("F", "B", "W", "B_plus_W", "BW", "F_unsplit", "BW_unsplit", "plain"):
            assert stage[f"{k}_ms"] > 0 and stage[f"{k}_faults"] >= 0
        assert stage["bw_over_fused"] == stage["B_plus_W_ms"] / stage["plain_ms"]
    # the runner's state is released: no microbatch lingers between variants
    # (a leak would show up as "forward ran twice" on the next repeat)
    run_split_backward_bench(configs=[TINY], repeats=2, warmup=1)
