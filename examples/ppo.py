"""The PPO step on the arithmetic task: `flowkit check examples/ppo.py`,
`flowkit graph ... -o ppo.svg`."""

from dataflows.ppo import ppo_flow
from dataflows.rl.ops import ARITHMETIC_RESPONSE_TOKENS

flow = ppo_flow(prompts=64, stages=2, schedule="zb-h1", max_new_tokens=ARITHMETIC_RESPONSE_TOKENS)
