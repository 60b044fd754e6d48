"""GRPO on the guessing game (dataflows.envs:GuessNumber, 3 guesses of a number in 1-4) with a
tiny float64 GPT from fresh weights, twice the games generated as trained (partial rollouts):
small enough for a resume test of trajectories in flight. Games whose secret is the highest
number answer slowly (SlowGuess), so every step has games still in flight when it has its
groups, whatever the machine's load: the resume test needs some cut."""

import time

from dataflows.envs import GuessNumber, guess_prompts
from dataflows.grpo import grpo_flow
from dataflows.rewards import environment_reward

TINY_GPT = {"vocab_size": 128, "block_size": 48, "n_layer": 2, "n_head": 2, "n_embd": 16,
            "dtype": "float64"}
GAME = {"low": 1, "high": 4}


class SlowGuess(GuessNumber):
    """GuessNumber that takes `slow_s` for its first answer in a game whose secret is `high`:
    such games lag the others, and their later turns are generated while the step cuts."""

    def __init__(self, low: int = 1, high: int = 16, slow_s: float = 0.0) -> None:
        super().__init__(low, high)
        self.slow_s, self.answered = float(slow_s), 0

    def step(self, action: str):
        if self.secret == self.high and self.answered == 0:
            time.sleep(self.slow_s)
        self.answered += 1
        return super().step(action)

    def state(self) -> dict:
        return {**super().state(), "answered": self.answered}

    def restore(self, state: dict) -> None:
        super().restore(state)
        self.answered = int(state["answered"])


flow = grpo_flow(prompts=4, n=4, stages=2, microbatches=2, schedule="1f1b", max_new_tokens=3,
                 lr=1e-2, gpt=TINY_GPT, prompt_source=guess_prompts, source_config=GAME,
                 reward=environment_reward, environment="tests.cli.flows.tiny_guess:SlowGuess",
                 env_config={**GAME, "slow_s": 0.05}, max_turns=3, oversample=2.0)
