"""GRPO on the guessing game (dataflows.envs:GuessNumber, 3 guesses of a number in 1-4) with a
tiny float64 GPT from fresh weights, twice the games generated as trained (partial rollouts):
small enough for a resume test of trajectories in flight. Games whose secret is the highest
numbers answer their first guess slowly (SlowGuess), so every step has games still in flight
when it has its groups, whatever the machine's load: the resume test needs some cut, and some
cut between a game's steps."""

import time

from dataflows.envs import GuessNumber, guess_prompts
from dataflows.grpo import grpo_flow
from dataflows.rewards import environment_reward

TINY_GPT = {"vocab_size": 128, "block_size": 48, "n_layer": 2, "n_head": 2, "n_embd": 16,
            "dtype": "float64"}
GAME = {"low": 1, "high": 4}


class SlowGuess(GuessNumber):
    """GuessNumber whose first answer takes `lags[i]` seconds in a game whose secret is
    `high - i`: such games lag the others, the slowest still answering when a step has its
    groups, the others playing their later turns, whatever the machine's load."""

    def __init__(self, low: int = 1, high: int = 16, lags: tuple = ()) -> None:
        super().__init__(low, high)
        self.lags, self.answered = tuple(float(s) for s in lags), 0

    def step(self, action: str):
        behind = self.high - self.secret
        if self.answered == 0 and behind < len(self.lags):
            time.sleep(self.lags[behind])
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
                 env_config={**GAME, "lags": [0.5, 0.05, 0.015]}, max_turns=3, oversample=2.0)
# the engine decodes 4 sequences at a time, so at a step's end most games in flight wait for a
# slot between their steps: cut there, each is checkpointed with its environment's state
flow.nodes["generate"].config["max_batch"] = 4
