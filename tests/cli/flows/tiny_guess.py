"""GRPO on the guessing game (dataflows.envs:GuessNumber, 3 guesses of a number in 1-4) with a
tiny float64 GPT from fresh weights, twice the games generated as trained (partial rollouts):
small enough for a resume test of trajectories in flight."""

from dataflows.envs import guess_prompts
from dataflows.grpo import grpo_flow
from dataflows.rewards import environment_reward

TINY_GPT = {"vocab_size": 128, "block_size": 48, "n_layer": 2, "n_head": 2, "n_embd": 16,
            "dtype": "float64"}
GAME = {"low": 1, "high": 4}

flow = grpo_flow(prompts=4, n=4, stages=2, microbatches=2, schedule="1f1b", max_new_tokens=3,
                 lr=1e-2, gpt=TINY_GPT, prompt_source=guess_prompts, source_config=GAME,
                 reward=environment_reward, environment="dataflows.envs:GuessNumber",
                 env_config=GAME, max_turns=3, oversample=2.0)
