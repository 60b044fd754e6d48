"""Ready-made environments for multi-turn rollouts [Note: multi-turn rollouts in
flowkit/ops/environments.py], and their prompt sources.

`GuessNumber`: guess a secret number from "higher" / "lower" feedback, a small multi-turn game
whose success needs the feedback (the prompt does not say the number). `guess_prompts` makes its
prompts, the secret in each prompt's answer. Give a flow `environment="dataflows.envs:GuessNumber"`
(its range in `env_config`), `max_turns` guesses and `reward=environment_reward`.
"""

from __future__ import annotations

import random
import re

from flowkit.dsl import Stream, op
from flowkit.ops import Environment, EnvStep
from flowkit.ops.records import Prompt

__all__ = ["GuessNumber", "guess_prompts"]

_NUMBER = re.compile(r"-?\d+")


class GuessNumber(Environment):
    """Each turn the model says a number in [low, high]; the environment answers "higher",
    "lower" or "right" (then the episode ends with reward 1). An answer without a number
    gets "say a number" and reward 0, as a wrong guess does."""

    def __init__(self, low: int = 1, high: int = 16) -> None:
        if not low <= high:
            raise ValueError(f"GuessNumber needs low <= high, got {low} and {high}")
        self.low, self.high = int(low), int(high)
        self.secret: int | None = None

    def reset(self, prompt: str, answer: str | None = None) -> None:
        if answer is None or not _NUMBER.fullmatch(answer.strip()):
            raise ValueError(f"GuessNumber's prompts carry the secret number as their answer "
                             f"(guess_prompts makes them), got {answer!r}")
        self.secret = int(answer)

    def step(self, action: str) -> EnvStep:
        found = _NUMBER.search(action)
        if found is None:
            return EnvStep(observation="say a number", info={"valid": False})
        guess = int(found.group())
        if guess == self.secret:
            return EnvStep(observation="right", reward=1.0, done=True)
        return EnvStep(observation="higher" if guess < self.secret else "lower",
                       info={"valid": self.low <= guess <= self.high})


@op
def guess_prompts(*, count: int = 16, seed: int = 0, step: int = 0, low: int = 1,
                  high: int = 16) -> Stream[Prompt]:
    """Step `step`'s `count` games: the prompt "guess LOW-HIGH:" and a secret drawn uniformly,
    its answer (what GuessNumber reads)."""
    rng = random.Random(f"{seed}:{step}")
    tokens = list(f"guess {low}-{high}:".encode())
    for k in range(count):
        yield Prompt(prompt_id=int(step) * int(count) + k, tokens=tokens,
                     answer=str(rng.randint(low, high)))
