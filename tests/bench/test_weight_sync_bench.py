"""`flowkit bench weight-sync`: both sides measured on the same executors, and the broadcast
moves only its records over the data plane (behaviour, not timings)."""

from __future__ import annotations

import pytest

from benchmarks.weight_sync import run_weight_sync_bench


@pytest.mark.slow
def test_the_weight_sync_bench_measures_both_sides_and_the_broadcast_sends_records_only():
    figures = run_weight_sync_bench(steps=2, rounds=1, n_embd=32, n_layer=2)
    host, broadcast = figures["host"], figures["broadcast"]
    assert host["steps_per_s"] > 0 and broadcast["steps_per_s"] > 0
    assert host["sync_bytes"] >= figures["model_bytes"]
    assert broadcast["sync_bytes"] < figures["model_bytes"] / 10
