"""GRPO on digit sorting with your own model, a small LSTM (examples/tiny_lstm.py), from the
supervised warm-up's weights (examples/lstm_sort_sft.py saves checkpoints/lstm.pt): 16 prompts x 8
samples a step, exact-match reward. Generation recomputes each prefix, as the LSTM has no cache:

    flowkit run examples/lstm_sort_sft.py --steps 600 --save-weights checkpoints
    flowkit run examples/lstm_grpo_sort.py --steps 40 --metrics lstm_grpo.jsonl
"""

from dataflows.grpo import grpo_flow
from dataflows.rl.tasks import SORT_RESPONSE_TOKENS, sort_prompts, sort_reward
from flowkit.dsl import Model

LSTM = {"vocab_size": 128, "n_embd": 32, "hidden": 128}

flow = grpo_flow(model=Model(name="lstm", build="tiny_lstm:TinyLSTM", stages=1, tags=("train",),
                             config={**LSTM, "checkpoint": "checkpoints/lstm.pt"}),
                 prompts=16, n=8, microbatches=2, schedule="1f1b",
                 max_new_tokens=SORT_RESPONSE_TOKENS,
                 kl_coef=0.001, lr=3e-3, prompt_source=sort_prompts, reward=sort_reward,
                 source_config={"digits": 3})
