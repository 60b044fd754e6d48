"""`flowkit bench train --precision`: its argument errors, and a short run's figures side by
side (docs/performance.md has the full run's)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from benchmarks.cli import bench
from benchmarks.train import TrainSetup, run_precision_bench


def test_a_precision_flowkit_does_not_have_is_a_usage_error():
    result = CliRunner().invoke(bench, ["train", "--precision", "bf16,fp16"])
    assert result.exit_code == 2
    assert "fp16: give fp32 and/or bf16" in result.output


@pytest.mark.slow
def test_both_precisions_train_the_same_model_on_the_same_executors():
    setup = TrainSetup(microbatches=2, batch_size=8, seq_len=32,
                       gpt={"vocab_size": 256, "block_size": 64, "n_layer": 2, "n_head": 2,
                            "n_embd": 32})
    out = run_precision_bench(("fp32", "bf16"), setup=setup, steps=3)
    fp32, bf16 = out["precisions"]["fp32"], out["precisions"]["bf16"]
    assert fp32["max_loss_gap"] == 0.0 and 0.0 < bf16["max_loss_gap"] < 0.02
    assert len(fp32["losses"]) == len(bf16["losses"]) == 3
    assert fp32["tokens_per_s"] > 0 and bf16["tokens_per_s"] > 0
