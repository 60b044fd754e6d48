"""GRPO on digit sorting with a tiny float64 GPT from fresh weights: the actor in 2 stages,
generation on its own executor: small enough for a resume test."""

from dataflows.grpo import grpo_flow
from dataflows.rl.tasks import sort_prompts, sort_reward

TINY_GPT = {"vocab_size": 128, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 16,
            "dtype": "float64"}

flow = grpo_flow(prompts=4, n=4, stages=2, microbatches=2, schedule="1f1b", max_new_tokens=6,
                 kl_coef=0.001, lr=1e-2, gpt=TINY_GPT, prompt_source=sort_prompts,
                 reward=sort_reward, source_config={"digits": 3})
