"""Small records and ops shared by the DSL tests, shaped like a real RL step."""

from __future__ import annotations

import attrs

from flowkit.dsl import Batch, Grouped, ModelOp, Stream, op


@attrs.frozen
class Prompt:
    prompt_id: int
    text: str


@attrs.frozen
class Rollout:
    prompt_id: int
    tokens: list[int]


@attrs.frozen
class Scored(Rollout):
    reward: float


class Generate(ModelOp):
    """Sample responses."""

    executor_op = "generate"
    inputs = {"prompts": Stream[Prompt]}
    outputs = {"rollouts": Stream[Rollout]}
    config = {"n": 1, "temperature": 1.0}


@op
def prompts(*, count: int = 4) -> Stream[Prompt]:
    yield from (Prompt(i, str(i)) for i in range(count))


@op
def score(rollout: Rollout) -> Scored:
    return Scored(rollout.prompt_id, rollout.tokens, reward=1.0)


@op
def advantages(group: Grouped[Scored]) -> Stream[Scored]:
    yield from group


@op
def train(batch: Batch[Scored]) -> float:
    return float(len(batch))
