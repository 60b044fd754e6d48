"""Pretraining the built-in GPT over 4 pipeline stages on a small corpus that ships with the repo.

    flowkit run examples/pretrain_pp.py --executors torch --stages 4 --microbatches 8 \
        --schedule zb-h1 --steps 50
"""

from pathlib import Path

from dataflows.pretrain import pretrain_flow

CORPUS = Path(__file__).parent / "data" / "corpus.txt"

flow = pretrain_flow(corpus=str(CORPUS), stages=4, microbatches=8, schedule="zb-h1")
