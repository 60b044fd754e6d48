"""The PPO step on the arithmetic task: `flowkit check examples/ppo.py`, `flowkit graph ... -o ppo.svg`."""

from dataflows.ppo import ppo_flow

flow = ppo_flow(prompts=64, stages=2, schedule="zb-h1")
