"""GRPO on a multi-turn game, from the warm-up's weights (examples/guess_sft.py): each sample is
a game of at most 3 guesses of a secret number in 1-8, the environment (dataflows.envs:
GuessNumber) answering "higher" or "lower" after each; reward 1 for a game won. The model's
guesses train, the environment's answers are context. 32 games x 8 samples a step:

    flowkit run examples/guess_sft.py --steps 300 --save-weights checkpoints
    flowkit run examples/guess_grpo.py --steps 40 --metrics guess.jsonl
"""

from dataflows.envs import GUESS_GPT, guess_prompts
from dataflows.grpo import grpo_flow
from dataflows.rewards import environment_reward

GAME = {"low": 1, "high": 8}

flow = grpo_flow(prompts=32, n=8, stages=2, microbatches=4, schedule="1f1b", kl_coef=0.001,
                 max_new_tokens=2, lr=3e-3, gpt={**GUESS_GPT, "checkpoint": "checkpoints/actor.pt"},
                 prompt_source=guess_prompts, source_config=GAME, reward=environment_reward,
                 environment="dataflows.envs:GuessNumber", env_config=GAME, max_turns=3,
                 # held-out games: another seed than the training games' (0)
                 eval_source=guess_prompts, eval_prompts=64,
                 eval_source_config={**GAME, "seed": 1})
