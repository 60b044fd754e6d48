"""@op functions the RL flow tests run on executors by import path, as flows' are, and the
multi-turn tests' environment."""

import attrs

from flowkit.dsl import op
from flowkit.ops import Environment, EnvStep
from flowkit.ops.records import Rollout, Scored


class Feedback(Environment):
    """Says how long each answer was; done after three (the multi-turn tests' environment)."""

    def __init__(self) -> None:
        self.turns = 0

    def step(self, action: str) -> EnvStep:
        self.turns += 1
        return EnvStep(observation=f"That was {len(action)} characters. Again?", reward=1.0,
                       done=self.turns == 3)


@op
def staged_reward(rollout: Rollout, *, step: int = 0) -> Scored:
    """Step 0: 0 for every sample, so dynamic sampling drops every group. Later steps: 1 for
    the even samples of an even prompt, else 0, so the even prompts' groups differ and the
    odd prompts' do not."""
    hit = step > 0 and rollout.prompt_id % 2 == 0 and rollout.sample % 2 == 0
    return Scored(**attrs.asdict(rollout, recurse=False), reward=float(hit))


@op
def second_round_reward(rollout: Rollout) -> Scored:
    """1 for the even samples of prompts 8 and up, else 0: with 4 prompts a step generating 8
    a round, only the second round's groups differ."""
    hit = rollout.prompt_id >= 8 and rollout.sample % 2 == 0
    return Scored(**attrs.asdict(rollout, recurse=False), reward=float(hit))


@op
def late_sample_reward(rollout: Rollout) -> Scored:
    """1 for sample 5 of an even prompt, else 0: 4 first samples of a prompt always agree, and
    a second round of 4 more (samples 4-7) makes an even prompt's group differ [Note: second
    rounds in flowkit/runner/second_round.py]."""
    hit = rollout.prompt_id % 2 == 0 and rollout.sample == 5
    return Scored(**attrs.asdict(rollout, recurse=False), reward=float(hit))


@op
def easy_or_late_reward(rollout: Rollout) -> Scored:
    """1 for every sample of an odd prompt (one every sample solves), and for sample 5 of an
    even one (late_sample_reward's): a second round "when they fail" samples again only the
    even prompts."""
    hit = rollout.prompt_id % 2 == 1 or rollout.sample == 5
    return Scored(**attrs.asdict(rollout, recurse=False), reward=float(hit))


@op
def even_token_reward(rollout: Rollout) -> Scored:
    """The share of the response's tokens that are even: a reward every sample earns some of,
    so each group's advantages differ from the first step (an untrained model learns from it)."""
    tokens = rollout.response_tokens
    share = sum(1 for t in tokens if t % 2 == 0) / len(tokens) if tokens else 0.0
    return Scored(**attrs.asdict(rollout, recurse=False), reward=share)
