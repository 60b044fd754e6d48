"""Streaming tasks: each item an op yields reaches the controller, and its consumers, the moment
it is yielded [Note: streaming ops in executors/optable.py]."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest

from flowkit.planner.lower import lower_flow
from flowkit.runner.flowrun import FlowRunner
from flowkit.wire.protocol import PROTOCOL_VERSION, ProtocolError, decode, encode, part_id
from tests.runner import flowdefs
from tests.runner.test_flowrun import FLOWDEFS

TRICKLE = {"target": flowdefs.trickle.target, "config": {"count": 3, "gap": 0.3},
           "outputs": ["out"], "many": [True]}


@pytest.fixture(scope="module")
def pair(pool):
    with pool.shared(2, code=[FLOWDEFS]) as started:
        yield started


def test_each_item_arrives_as_its_own_future_before_the_task_ends(pair):
    ctl, (first, second) = pair
    parts, arrived = [], []
    got = threading.Event()

    def on_part(part):
        parts.append(part)
        arrived.append(time.time())
        got.set()

    whole = ctl.submit("python", config=TRICKLE, executor=first.id, on_part=on_part)
    assert got.wait(timeout=10) and not whole.done()  # the first item, while the op runs on
    # a consumer elsewhere reads the first item alone, while the producer still yields
    copied = ctl.submit("identity", parts[0], executor=second.id)
    assert copied.result(timeout=5) == flowdefs.Sample(key=0, value=0.0)
    whole.result(timeout=10)
    assert copied.timing[1] < whole.timing[1] - 0.2  # done while the producer still yielded
    assert [p.result(timeout=5).key for p in parts] == [0, 1, 2]
    assert [p.id for p in parts] == [part_id(whole.id, i) for i in range(3)]
    assert arrived[2] - arrived[0] >= 0.5  # they came as yielded, not together at the end
    assert whole.count == 3 and whole.result(timeout=5) == [p.result() for p in parts]


def test_a_task_that_does_not_stream_still_returns_its_list(pair):
    ctl, (first, _) = pair
    parts = []
    whole = ctl.submit("identity", [1, 2], executor=first.id, on_part=parts.append)
    assert whole.result(timeout=5) == [1, 2] and parts == []


def test_a_streaming_task_must_have_one_output(pair):
    ctl, (first, _) = pair
    with pytest.raises(ValueError, match="one output"):
        ctl.submit("python", config=TRICKLE, executor=first.id, outputs=2, on_part=print)


@pytest.mark.parametrize(("fields", "error"), [
    ({"task": 1, "index": 0, "end": 1.0}, "missing field 'output'"),
    ({"task": 1, "index": "0", "end": 1.0, "output": {"id": 1, "nbytes": 0}}, "'index' must be"),
    ({"task": 1, "index": 0, "end": 1.0, "output": {"id": 1}}, "part output: missing field"),
])
def test_a_malformed_part_message_is_a_protocol_error(fields, error):
    with pytest.raises(ProtocolError, match=error):
        decode([msgpack.packb({"v": PROTOCOL_VERSION, "t": "part", **fields})])
    decode(encode("part", {"task": 1, "index": 0, "end": 1.0, "output": {"id": 1, "nbytes": 0}}))


def test_a_part_id_is_out_of_the_controllers_own_range_and_bounded():
    assert part_id(7, 0) != part_id(7, 1) != part_id(8, 0)
    assert part_id(1, 0) > 2**61
    with pytest.raises(ProtocolError, match="at most"):
        part_id(1, 1 << 20)


def test_per_item_consumers_start_before_the_streaming_op_ends(pair):
    ctl, _ = pair
    runner = FlowRunner(ctl, lower_flow(flowdefs.trickle_flow(gap=0.3)))
    runner.run_step(0)
    trickle_end = runner.states["trickle"].last_end
    assert runner.states["plus_one"].first_start < trickle_end - 0.3
    assert [ref.result(timeout=5) for ref in runner.previous[("total", "out")].ordered()] == [6.0]


def test_unfused_the_same_flow_gives_the_same_result_without_streaming(pair):
    ctl, _ = pair
    runner = FlowRunner(ctl, lower_flow(flowdefs.trickle_flow(gap=0.0)), fuse=False)
    runner.run_step(0)
    assert [ref.result(timeout=5) for ref in runner.previous[("total", "out")].ordered()] == [6.0]


def test_a_samples_reward_starts_before_the_other_samples_of_its_prompt_finish(pool):
    """GRPO on simulator executors whose generation takes 100 ms a token: each sample is
    scored as soon as it is done, on the other executor, while its prompt's longer samples
    still decode."""
    from dataflows.grpo import grpo_flow
    from flowkit.planner.simcosts import SimCosts

    flow = grpo_flow(prompts=1, n=4, stages=1, microbatches=2, max_new_tokens=16)
    with pool.shared(2, kind="sim", tags=("train", "rollout")) as (ctl, _):
        runner = FlowRunner(ctl, lower_flow(flow), sim_costs=SimCosts(token=0.1))
        runner.run_step(0)
    generated = runner.previous[("generate", "rollouts")]
    rewards = runner.previous[("answer_reward", "out")]
    early = _scored_before_prompt_done(generated, rewards)
    assert max(early) > 0.05, early  # scored while its prompt was still generating


def test_on_torch_a_sample_is_scored_while_its_prompt_still_generates(pool):
    """The torch rollout engine streams too: an early sample's reward starts before its
    prompt's last sample is generated (the trace shows the same spans)."""
    flow = flowdefs.torch_streaming_flow()
    with pool.shared(2, kind="torch", tags=[("rollout",), ("score",)],
                          code=[FLOWDEFS]) as (ctl, _):
        runner = FlowRunner(ctl, lower_flow(flow))
        runner.run_step(0)
    generated = runner.previous[("generate", "rollouts")]
    scored = runner.previous[("length_reward", "out")]
    early = _scored_before_prompt_done(generated, scored)
    assert max(early) > 0, early


def _scored_before_prompt_done(generated, scored) -> list[float]:
    """Per prompt: how long before its last sample was generated its first one was scored
    (the spans' wall-clock times)."""
    early = []
    for prompt in {lineage[:-1] for lineage in generated.items}:
        samples = [lin for lin in generated.items if lin[:-1] == prompt]
        last_done = max(generated.items[lin].timing[1] for lin in samples)
        first_scored = min(scored.items[lin].timing[0] for lin in samples)
        early.append(last_done - first_scored)
    return early


@pytest.mark.parametrize(("fields", "error"), [
    ({"task": 1, "index": 0, "end": 1.0}, "missing field 'outputs'"),
    ({"task": 1, "index": 0, "end": 1.0, "outputs": [3]}, "an output must be a map"),
    ({"task": 1, "index": 0, "end": 1.0, "outputs": [{"id": 1}]}, "part output: missing"),
])
def test_a_malformed_parts_message_is_a_protocol_error(fields, error):
    # [Note: parts in batches in executors/process.py]: several parts in one message
    with pytest.raises(ProtocolError, match=error):
        decode([msgpack.packb({"v": PROTOCOL_VERSION, "t": "parts", **fields})])
    decode(encode("parts", {"task": 1, "index": 0, "end": 1.0,
                            "outputs": [{"id": 1, "nbytes": 0}, {"id": 2, "nbytes": 0}]}))
