"""Pipeline pretraining of a tiny float64 GPT in 2 stages: small enough for a resume test."""

from pathlib import Path

from dataflows.pretrain import pretrain_flow

CORPUS = Path(__file__).resolve().parents[3] / "examples" / "data" / "corpus.txt"
TINY_GPT = {"vocab_size": 256, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 16,
            "dtype": "float64"}

flow = pretrain_flow(corpus=str(CORPUS), stages=2, microbatches=4, schedule="1f1b",
                     batch_size=8, seq_len=16, gpt=TINY_GPT, lr=3e-3)

# the same flow with a wider model: a checkpoint of `flow` must not resume it
wider = pretrain_flow(corpus=str(CORPUS), stages=2, microbatches=4, schedule="1f1b",
                      batch_size=8, seq_len=16, gpt={**TINY_GPT, "n_embd": 32}, lr=3e-3)
