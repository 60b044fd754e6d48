"""Supervised warm-up of your own model, a small LSTM (examples/tiny_lstm.py), on the digit-sorting
task of examples/sort_sft.py: it learns the format from noisy demonstrations (only 20 % sorted
right), so that GRPO (examples/lstm_grpo_sort.py) has a clear direction to learn:

    flowkit run examples/lstm_sort_sft.py --steps 600 --save-weights checkpoints
    flowkit run examples/lstm_grpo_sort.py --steps 40 --metrics lstm_grpo.jsonl
"""

from dataflows.pretrain import pretrain_flow
from dataflows.rl.tasks import sort_sequences
from flowkit.dsl import Model

LSTM = {"vocab_size": 128, "n_embd": 32, "hidden": 128}

flow = pretrain_flow(model=Model(name="lstm", build="tiny_lstm:TinyLSTM", config=LSTM, stages=1,
                                 tags=("train",)),
                     source=sort_sequences, source_config={"digits": 3, "correct_fraction": 0.2},
                     batch_size=64, microbatches=1, schedule="1f1b", lr=1e-2, name="lstm_sort_sft")
