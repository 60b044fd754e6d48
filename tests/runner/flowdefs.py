"""Small flows for the runner's tests; executors import this file (`--code`) to run its ops."""

from __future__ import annotations

import time

import attrs

from flowkit.dsl import Batch, Flow, Grouped, Metrics, Model, Stream, collect, group_by, op
from flowkit.ops.records import Prompt, Rollout, Scored


@attrs.frozen
class Sample:
    key: int
    value: float


@op
def samples(*, count: int = 6, keys: int = 3) -> Stream[Sample]:
    for i in range(count):
        yield Sample(key=i % keys, value=float(i))


@op
def slow_double(sample: Sample, *, last_delay: float = 0.0) -> Sample:
    """Doubles the value; the sample with the highest value is slow, a long tail."""
    if sample.value == 5.0:
        time.sleep(last_delay)
    return Sample(key=sample.key, value=sample.value * 2)


@op
def plus_one(sample: Sample) -> Sample:
    return Sample(key=sample.key, value=sample.value + 1)


@op
def pair(a: Sample, b: Sample) -> Sample:
    assert a.key == b.key, "per-item inputs must pair by sample"
    return Sample(key=a.key, value=a.value + b.value)


@op
def group_sum(group: Grouped[Sample]) -> Sample:
    return Sample(key=group[0].key, value=sum(s.value for s in group))


@op
def total(groups: Batch[Sample]) -> float:
    return sum(s.value for s in groups)


@op
def explode(sample: Sample) -> Sample:
    raise ValueError(f"sample {sample.key} exploded")


def grouped_flow(last_delay: float = 0.0) -> Flow:
    """samples -> double and +1 per item -> pair them -> sum per key (groups of 2) -> total."""
    with Flow("grouped") as flow:
        items = samples(count=6, keys=3)
        doubled = slow_double(items, last_delay=last_delay)
        pairs = pair(doubled, plus_one(items))
        total(collect(group_sum(group_by(pairs, key="key", size=2))))
    return flow


@op(tags=("map",))
def slow_double_on_map(sample: Sample, *, last_delay: float = 0.0) -> Sample:
    return slow_double.fn(sample, last_delay=last_delay)


@op(tags=("reduce",))
def group_sum_on_reduce(group: Grouped[Sample]) -> Sample:
    return group_sum.fn(group)


def tail_flow(last_delay: float) -> Flow:
    """samples -> double per item on 'map' executors (one slow) -> sum per key on a 'reduce'
    executor as soon as a key's pair is in -> total."""
    with Flow("tail") as flow:
        doubled = slow_double_on_map(samples(count=6, keys=3), last_delay=last_delay)
        total(collect(group_sum_on_reduce(group_by(doubled, key="key", size=2))))
    return flow


def failing_flow() -> Flow:
    with Flow("failing") as flow:
        total(collect(explode(samples(count=3))))
    return flow


@op
def unsendable() -> Sample:
    """Returns what no wire format can carry (a generator), to test how that fails."""
    return (i for i in range(3))  # type: ignore[return-value]


@op
def mislabelled(sample: Sample) -> Sample:
    """Promises a Sample and returns a float: the mistake must be blamed on this op."""
    return sample.value  # type: ignore[return-value]


def mislabelled_flow() -> Flow:
    with Flow("mislabelled") as flow:
        total(collect(plus_one(mislabelled(samples(count=2)))))
    return flow


@op
def noted(groups: Batch[Sample]) -> Metrics:
    """A reporter with a warning, as rollout_metrics gives when responses were cut."""
    return Metrics({"groups": float(len(groups))}, warnings=("something to act on",))


def short_groups_flow() -> Flow:
    """Keys of 2 samples grouped by 3: sizes only known at run time, so every group runs short."""
    with Flow("short_groups") as flow:
        noted(collect(group_sum(group_by(samples(count=6, keys=3), key="key", size=3))))
    return flow


@op
def trickle(*, count: int = 3, gap: float = 0.3) -> Stream[Sample]:
    """Items that take a while each, like samples finishing one after another."""
    for i in range(count):
        if i:
            time.sleep(gap)
        yield Sample(key=i, value=float(i))


def trickle_flow(gap: float = 0.3) -> Flow:
    with Flow("trickle") as flow:
        total(collect(plus_one(trickle(count=3, gap=gap))))
    return flow


@op
def short_prompts(*, count: int = 2) -> Stream[Prompt]:
    for i in range(count):
        yield Prompt(prompt_id=i, tokens=[1, 2, 3])


@op
def length_reward(rollout: Rollout) -> Scored:
    reward = float(len(rollout.response_tokens))
    return Scored(**attrs.asdict(rollout, recurse=False), reward=reward)


@op
def mean_reward(scored: Batch[Scored]) -> float:
    return sum(s.reward for s in scored) / max(1, len(scored))


def torch_streaming_flow() -> Flow:
    """A random 128-token GPT generating: byte 10, the generator's EOS, comes up about one token
    in 128, so a prompt's samples end at widely different lengths (hundreds of decoding
    iterations apart, 0.8-1 s on a quiet machine: room for a loaded one), each scored as it
    ends."""
    from dataflows.model_ops import Generate
    from dataflows.models import GPT_BUILD

    actor = Model(name="actor", build=GPT_BUILD, tags=("rollout",),
                  config={"vocab_size": 128, "block_size": 640, "n_layer": 2, "n_head": 2,
                          "n_embd": 64})
    with Flow("torch_streaming") as flow:
        rollouts = Generate(actor)(short_prompts(count=2), n=6, max_new_tokens=600)
        mean_reward(collect(length_reward(rollouts)))
    return flow


def paired_flow(count: int) -> Flow:
    """`count` samples, each doubled and incremented by two per-item ops whose outputs a third
    pairs up by sample, then summed: the per-item bookkeeping of a step, at any size."""
    with Flow("paired") as flow:
        source = samples(count=count, keys=count)
        total(collect(pair(plus_one(source), slow_double(source))))
    return flow


@op
def paced_samples(*, count: int = 200, keys: int = 8, gap: float = 0.001) -> Stream[Sample]:
    """`count` samples, one every `gap` seconds: a stream faster than its consumer."""
    for i in range(count):
        time.sleep(gap)
        yield Sample(key=i % keys, value=float(i))


@op
def slow_plus_one(sample: Sample, *, seconds: float = 0.01) -> Sample:
    time.sleep(seconds)
    return Sample(key=sample.key, value=sample.value + 1)


def paced_flow(count: int) -> Flow:
    """A stream faster than its per-item consumer, then groups of a key's items, then a total."""
    with Flow("paced") as flow:
        plus = slow_plus_one(paced_samples(count=count, keys=8))
        total(collect(group_sum(group_by(plus, key="key", size=count // 8))))
    return flow


@op
def step_samples(*, count: int = 4, step: int = 0, fail_at: int = -1,
                 gap: float = 0.0) -> Stream[Sample]:
    """`count` samples of step `step`, each valued by it, `gap` s apart (fails at step
    `fail_at`)."""
    if step == fail_at:
        raise ValueError(f"no samples for step {step}")
    for i in range(count):
        if gap:
            time.sleep(gap)
        yield Sample(key=i % 2, value=float(step * 1000 + i))


def stepped_flow(count: int = 4, delay: float = 0.0, fail_at: int = -1,
                 gap: float = 0.0) -> Flow:
    """step_samples -> double each (the one valued 5 after `delay`) -> total."""
    with Flow("stepped") as flow:
        total(collect(slow_double(step_samples(count=count, fail_at=fail_at, gap=gap),
                                  last_delay=delay)))
    return flow


@op(tags=("src",))
def step_samples_on_src(*, count: int = 4, step: int = 0, gap: float = 0.0) -> Stream[Sample]:
    yield from step_samples.fn(count=count, step=step, gap=gap)


@op(tags=("work",))
def plus_one_on_work(sample: Sample) -> Sample:
    return plus_one.fn(sample)


@op(tags=("work",))
def total_on_work(groups: Batch[Sample]) -> float:
    return total.fn(groups)


def split_flow(count: int, gap: float) -> Flow:
    """step_samples on a `src` executor -> +1 and the total on a `work` one."""
    with Flow("split") as flow:
        total_on_work(collect(plus_one_on_work(step_samples_on_src(count=count, gap=gap))))
    return flow
