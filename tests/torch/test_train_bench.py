"""`flowkit bench train` on a tiny setup: every figure it reports is there and sane."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks.train import TrainSetup, run_train_bench
from executors.torch.train.memory import keep_freed_memory
from tests.harness import tiny_gpt, tiny_split_bench

TINY_GPT = tiny_gpt(vocab_size=256, block_size=16, n_embd=16)


@pytest.mark.slow
def test_the_train_bench_reports_split_backward_bubbles_and_tokens_per_s():
    setup = TrainSetup(stages=2, microbatches=2, batch_size=4, seq_len=8, steps=3, gpt=TINY_GPT)
    tiny = tiny_split_bench(2)
    result = run_train_bench(setup, schedules=("1f1b", "zb-h1"),
                             split_backward={"configs": [tiny], "repeats": 1, "warmup": 0})
    assert json.loads(json.dumps(result)) == result
    assert result["split_backward"]["bw_over_fused"] > 0
    for kind in ("1f1b", "zb-h1"):
        figures = result["schedules"][kind]
        assert 0 <= figures["measured_bubble_rate"] < 1
        assert 0 <= figures["predicted_bubble_rate"] < 1
        assert figures["tokens_per_s"] > 0
    assert result["plain_loop"]["tokens_per_s"] > 0
    assert result["pipeline_over_plain_tokens_per_s"] > 0


def test_freed_memory_stays_in_the_process_on_glibc():
    if sys.platform == "linux":
        assert keep_freed_memory()


@pytest.mark.slow
def test_the_train_bench_measures_hugging_face_decoder_layers_with_model():
    import attrs
    import pytest

    pytest.importorskip("transformers", reason="the hf extra: pip install 'flowkit[hf]'")
    setup = TrainSetup(stages=2, microbatches=2, batch_size=4, seq_len=8, steps=2, gpt=TINY_GPT)
    tiny = attrs.evolve(tiny_split_bench(2), architecture="llama")
    result = run_train_bench(setup, schedules=("zb-h1",), model="llama",
                             split_backward={"configs": [tiny], "repeats": 1, "warmup": 0})
    assert result["setup"]["model"] == "llama"
    assert result["split_backward"]["configs"][0]["config"]["architecture"] == "llama"
    assert result["split_backward"]["bw_over_fused"] > 0
    assert result["schedules"]["zb-h1"]["tokens_per_s"] > 0
    assert result["plain_loop"]["tokens_per_s"] > 0
