"""Small records, ops and flows shared by the DSL tests, shaped like a real RL step."""

from __future__ import annotations

import attrs

from flowkit.dsl import Batch, Flow, Grouped, ModelOp, Stream, collect, group_by, op


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


@op
def step(x: float) -> float:
    """A state carried from one step to the next."""
    return x


def grpo_step(actor) -> Flow:
    with Flow("grpo") as flow:
        rollouts = Generate(actor)(prompts(count=8), n=4)
        adv = advantages(group_by(score(rollouts), key="prompt_id", size=4))
        train(collect(adv))
    return flow


def wired(ops, *wires: tuple[str, str]) -> Flow:
    """A flow of `ops` (each an op, or an (op, name) pair) wired by hand, unchecked: what
    `with Flow` would refuse to build."""
    flow = Flow("f")
    for each in ops:
        operator, name = each if isinstance(each, tuple) else (each, None)
        flow.add(operator, name=name)
    for source, target in wires:
        flow.connect(source, target)
    return flow


def rules_of(flow: Flow) -> list[str]:
    return [p.rule for p in flow.check()]
