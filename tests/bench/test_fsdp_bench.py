"""`flowkit bench train --fsdp`: a short run's figures side by side (docs/performance.md has the
full run's): FSDP's replicas keep half the state bytes of whole replicas and train the same
losses."""

from __future__ import annotations

import pytest

from benchmarks.fsdp import run_fsdp_bench


def test_fsdp_replicas_keep_half_the_bytes_and_train_the_same_losses():
    out = run_fsdp_bench(steps=2, rounds=1)
    whole, sharded = out["replicas"], out["fsdp"]
    assert len(whole["bytes_per_replica"]) == len(sharded["bytes_per_replica"]) == 2
    for kind in ("params", "grads", "optimizer"):
        for share, full in zip(sharded["bytes_per_replica"], whole["bytes_per_replica"]):
            assert 0.45 * full[kind] <= share[kind] <= 0.55 * full[kind], kind
    assert 0.45 <= out["fsdp_over_replicas_bytes"] <= 0.55
    assert sharded["losses"] == pytest.approx(whole["losses"], abs=1e-5)
    assert whole["tokens_per_s"] > 0 and sharded["tokens_per_s"] > 0
