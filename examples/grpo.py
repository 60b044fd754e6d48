"""The GRPO step on the arithmetic task, 8 samples per prompt: `flowkit check examples/grpo.py`."""

from dataflows.grpo import grpo_flow
from dataflows.rl.ops import ARITHMETIC_RESPONSE_TOKENS

flow = grpo_flow(prompts=16, n=8, stages=2, schedule="zb-h1",
                 max_new_tokens=ARITHMETIC_RESPONSE_TOKENS)
