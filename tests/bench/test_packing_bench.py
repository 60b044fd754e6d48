"""`flowkit bench train --packing`: a short run's figures side by side, the packed run's losses
the padded one's (docs/performance.md has the full run's), and its data: log-normal lengths."""

from __future__ import annotations

import math
import statistics

from benchmarks.packing import PackingSetup, lognormal_experiences, run_packing_bench


def test_the_samples_have_the_asked_log_normal_lengths():
    samples = list(lognormal_experiences.fn(sequences=2000, step=3))
    lengths = [len(e.response_tokens) for e in samples]
    assert 56 <= statistics.median(lengths) <= 72 and max(lengths) == 512
    logs = [math.log(n) for n in lengths if 1 < n < 512]
    assert 0.85 < statistics.stdev(logs) < 1.1
    again = list(lognormal_experiences.fn(sequences=2000, step=3))
    assert [e.response_tokens for e in again] == [e.response_tokens for e in samples]


def test_packed_and_padded_train_the_same_steps_side_by_side():
    setup = PackingSetup(batch_size=12, microbatches=2, steps=2,
                         gpt={"vocab_size": 256, "block_size": 544, "n_layer": 2, "n_head": 2,
                              "n_embd": 16})
    out = run_packing_bench(setup)
    assert len(out["padded"]["losses"]) == len(out["packed"]["losses"]) == 2
    assert out["max_loss_gap"] < 1e-5  # float32: the same losses to rounding
    assert out["packed"]["tokens_per_s"] > 0 and out["padded"]["tokens_per_s"] > 0
    assert out["packed_over_padded_tokens_per_s"] > 0
