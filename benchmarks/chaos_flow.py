"""The flow `flowkit bench chaos` kills executors of: pipeline pretraining of a tiny float64 GPT
in 2 stages, a step of a few tens of milliseconds (tests/cli/flows/tiny_pretrain.py's)."""

from pathlib import Path

from dataflows.pretrain import pretrain_flow

CORPUS = Path(__file__).resolve().parents[1] / "examples" / "data" / "corpus.txt"
TINY_GPT = {"vocab_size": 256, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 16,
            "dtype": "float64"}

flow = pretrain_flow(corpus=str(CORPUS), stages=2, microbatches=4, schedule="1f1b",
                     batch_size=8, seq_len=16, gpt=TINY_GPT, lr=3e-3)
