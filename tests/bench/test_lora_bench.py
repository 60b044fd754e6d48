"""`flowkit bench lora`: the LoRA run and the full run are measured side by side on the same
executors, and the LoRA run trains and syncs its adapters only (behaviour, not timings)."""

from __future__ import annotations

import pytest

from benchmarks.lora import run_lora_bench


@pytest.mark.slow
def test_the_lora_bench_measures_both_sides_and_lora_moves_the_adapters_only():
    figures = run_lora_bench(steps=2, rounds=1, rank=2, n_embd=32, n_layer=2)
    full, lora, ratio = figures["full"], figures["lora"], figures["lora_over_full"]
    assert full["steps_per_s"] > 0 and lora["steps_per_s"] > 0
    assert ratio["steps_per_s"] == lora["steps_per_s"] / full["steps_per_s"]
    # blocks x rank x (in + out) of attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj at width 32
    assert lora["trained_parameters"] == 2 * 2 * ((32 + 96) + (32 + 32) + (32 + 128) + (128 + 32))
    assert ratio["sync_bytes"] < 0.2 and lora["sync_bytes"] > 0
