"""Supervised warm-up for the digit-sorting RL example: the built-in GPT, two pipeline stages,
learns the format ("sort 419:" -> "149\\n") from noisy demonstrations (only 20 % sorted right,
the rest sorted backwards), so it starts RL knowing the format but mostly wrong:

    flowkit run examples/sort_sft.py --steps 600 --save-weights checkpoints
    flowkit run examples/grpo_sort.py --steps 40 --metrics grpo.jsonl
"""

from dataflows.pretrain import pretrain_flow
from dataflows.rl.tasks import SORT_GPT, sort_sequences

flow = pretrain_flow(source=sort_sequences, source_config={"digits": 3, "correct_fraction": 0.2},
                     batch_size=64, stages=2, microbatches=4, schedule="1f1b", gpt=SORT_GPT,
                     lr=2e-3, model_name="actor", name="sort_sft")
