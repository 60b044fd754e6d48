"""Ready-made environments for multi-turn rollouts [Note: multi-turn rollouts in
flowkit/ops/environments.py], and their prompt sources.

`GuessNumber`: guess a secret number from "higher" / "lower" feedback, a small multi-turn game
whose success needs the feedback (the prompt does not say the number). `guess_prompts` makes its
prompts, the secret in each prompt's answer. Give a flow `environment="dataflows.envs:GuessNumber"`
(its range in `env_config`), `max_turns` guesses and `reward=environment_reward`.
`guess_transcripts` are games played by a noisy demonstrator, for a supervised warm-up of the
built-in GPT on bytes (examples/guess_sft.py).

The calculator task: `product_prompts` asks for products too large for a small model to
multiply ("123*45="), which dataflows.tools' ToolEnvironment with its `calculator` answers in
one call; `calculator_transcripts` are a demonstrator's answers that call it now and then, for a
warm-up (examples/calculator_sft.py).
"""

from __future__ import annotations

import random
import re

from flowkit.dsl import Stream, op
from flowkit.ops import Environment, EnvStep
from flowkit.ops.records import Prompt, TokenIds

__all__ = ["CALCULATOR_GPT", "GUESS_GPT", "GuessNumber", "calculator_transcripts", "guess_prompts",
           "guess_transcripts", "product_prompts"]

CALCULATOR_GPT = {"vocab_size": 128, "block_size": 48, "n_layer": 2, "n_head": 4, "n_embd": 64}
"""The built-in GPT of the calculator examples: bytes, room for a question, a call and the
answer."""

GUESS_GPT = {"vocab_size": 128, "block_size": 48, "n_layer": 2, "n_head": 4, "n_embd": 64}
"""The built-in GPT of the guessing examples: bytes, room for a prompt and three turns."""

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

    def state(self) -> dict:
        """The game as plain data: a trajectory cut between guesses goes on elsewhere."""
        return {"secret": self.secret}

    def restore(self, state: dict) -> None:
        secret = state["secret"]
        if not isinstance(secret, int) or isinstance(secret, bool):
            raise ValueError(f"a GuessNumber state's secret is a number, got {secret!r}")
        self.secret = secret


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


@op
def guess_transcripts(*, sequences: int = 64, seed: int = 0, step: int = 0, low: int = 1,
                      high: int = 8, turns: int = 3, follow_fraction: float = 0.5,
                      bisect_fraction: float = 0.0, length: int = 48) -> Stream[TokenIds]:
    """`sequences` games as the engine renders them ("guess 1-8:" "4\\n" "higher\\n" "6\\n"
    ...), `length` int64 ids each: the model's guesses are trained, the prompt, the
    environment's answers and the padding only read (~t entries, flowkit.ops.records.TokenIds).
    The demonstrator follows the feedback (a number still possible, at random) in
    `follow_fraction` of its guesses and guesses anywhere in the range otherwise, for at most
    `turns` guesses: it knows the format and wins sometimes, what RL then improves. Of the
    guesses that follow, `bisect_fraction` take the middle of what is still possible (binary
    search, the best play) rather than any of it."""
    import torch  # only executors run these ops; declaring a flow must not need torch

    rng = random.Random(f"guess-sft/{seed}/{step}")
    for _ in range(sequences):
        secret, lo, hi = rng.randint(low, high), low, high
        ids = [~t for t in f"guess {low}-{high}:".encode()]
        for _turn in range(turns):
            follow = rng.random() < follow_fraction and lo <= hi
            bisect = follow and bisect_fraction > 0 and rng.random() < bisect_fraction
            guess = ((lo + hi) // 2 if bisect else rng.randint(lo, hi)) if follow \
                else rng.randint(low, high)
            ids += list(f"{guess}\n".encode())
            if guess == secret:
                break
            lo, hi = (max(lo, guess + 1), hi) if guess < secret else (lo, min(hi, guess - 1))
            ids += [~t for t in ("higher\n" if guess < secret else "lower\n").encode()]
        if len(ids) > length:
            raise ValueError(f"guess_transcripts: a game of {len(ids)} tokens does not fit "
                             f"length={length}")
        yield torch.tensor(ids + [~0] * (length - len(ids)), dtype=torch.int64)


@op
def product_prompts(*, count: int = 16, seed: int = 0, step: int = 0) -> Stream[Prompt]:
    """Step `step`'s `count` questions "A*B=" (A of 3 digits, B of 2), the product their
    answer."""
    rng = random.Random(f"product/{seed}/{step}")
    for k in range(count):
        a, b = _factors(rng)
        yield Prompt(prompt_id=int(step) * int(count) + k, tokens=list(f"{a}*{b}=".encode()),
                     answer=str(a * b))


@op
def calculator_transcripts(*, sequences: int = 64, seed: int = 0, step: int = 0,
                           call_fraction: float = 0.25, length: int = 48) -> Stream[TokenIds]:
    """`sequences` answers to product questions as the engine renders them, `length` int64 ids
    each, the model's turns trained and the rest only read (as guess_transcripts'). In
    `call_fraction` of them the demonstrator calls the calculator ("calculator(123*45)\\n",
    the result "5535\\n") and copies its result; in the others it answers at once, a number of
    the right length whose leading digits are right and the rest made up."""
    import torch  # only executors run these ops; declaring a flow must not need torch

    rng = random.Random(f"calculator-sft/{seed}/{step}")
    for _ in range(sequences):
        a, b = _factors(rng)
        product = str(a * b)
        ids = [~t for t in f"{a}*{b}=".encode()]
        if rng.random() < call_fraction:
            ids += list(f"calculator({a}*{b})\n".encode())
            ids += [~t for t in f"{product}\n".encode()]
            ids += list(f"{product}\n".encode())
        else:
            guess = product[:2] + "".join(rng.choice("0123456789") for _ in product[2:])
            ids += list(f"{guess}\n".encode())
        if len(ids) > length:
            raise ValueError(f"calculator_transcripts: {len(ids)} tokens do not fit {length}")
        yield torch.tensor(ids + [~0] * (length - len(ids)), dtype=torch.int64)


def _factors(rng: random.Random) -> tuple[int, int]:
    return rng.randint(100, 999), rng.randint(10, 99)
