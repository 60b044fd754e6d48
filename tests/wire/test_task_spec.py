"""A TaskSpec is encoded once and decoded once [Note: a task on the wire in
flowkit/wire/task.py]: any valid task survives the round trip through a RUN message, and a
malformed one is refused with a ProtocolError that names the field at fault."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowkit.wire.protocol import Msg, ProtocolError, decode, encode
from flowkit.wire.task import MalformedTask, RejectedTask, TaskSpec, decode_tasks

ids = st.integers(min_value=0, max_value=2**63 - 1)
names = st.text(max_size=12)
plain = (st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1)
         | st.floats(allow_nan=False) | names)
configs = st.dictionaries(names, plain | st.lists(plain, max_size=3), max_size=4)
refs = st.recursive(ids | st.lists(ids, min_size=2, max_size=2),
                    lambda inner: st.builds(lambda parts: {"gather": parts},
                                            st.lists(inner, max_size=3)),
                    max_leaves=6)


@st.composite
def task_specs(draw) -> TaskSpec:
    stream = draw(st.booleans())
    outputs = draw(st.lists(ids, min_size=1, max_size=1) if stream else st.lists(ids, max_size=4))
    return TaskSpec(draw(names), draw(configs), draw(st.lists(refs, max_size=4)), outputs,
                    draw(ids), draw(st.none() | names), draw(st.none() | names),
                    draw(st.none() | names), stream)


def _sent(spec: TaskSpec) -> list:
    header, _ = decode(encode(Msg.RUN, {"tasks": [spec.encode()]}))
    return header["specs"]


@given(task_specs())
def test_any_valid_task_spec_survives_the_round_trip(spec):
    assert _sent(spec) == [spec]


@given(task_specs())
def test_a_spec_encoded_with_its_numbers_decodes_whole(spec):
    # as the controller sends it: built before its id, input refs and output ids are known
    unnumbered = TaskSpec(spec.op, spec.config, lane=spec.lane, report_key=spec.report_key,
                          trace_key=spec.trace_key, stream=spec.stream)
    assert TaskSpec.decode(unnumbered.encode_as(spec.id, spec.inputs, spec.outputs)) == spec


def _body(**changes) -> dict:
    body = {"id": 7, "op": "noop", "config": {}, "inputs": [1, [2, 0]], "outputs": [3]}
    body.update(changes)
    return {key: value for key, value in body.items() if value is not _DROP}


_DROP = object()
_NOT_A_NAME = st.integers() | st.lists(names, max_size=2) | st.binary(max_size=4)


@pytest.mark.parametrize(("changes", "field"), [
    ({"id": _DROP}, "'id'"), ({"id": "7"}, "'id'"), ({"id": True}, "'id'"), ({"id": -1}, "'id'"),
    ({"op": _DROP}, "'op'"), ({"op": 5}, "'op'"),
    ({"config": _DROP}, "'config'"), ({"config": [1]}, "'config'"),
    ({"inputs": _DROP}, "'inputs'"), ({"inputs": 4}, "'inputs'"),
    ({"outputs": _DROP}, "'outputs'"), ({"outputs": {}}, "'outputs'"),
])
def test_a_task_that_cannot_be_named_makes_its_message_malformed(changes, field):
    with pytest.raises(ProtocolError, match=field) as raised:
        decode(encode(Msg.RUN, {"tasks": [_body(), _body(**changes)]}))
    assert not isinstance(raised.value, MalformedTask)


def test_a_task_that_is_no_map_makes_its_message_malformed():
    with pytest.raises(ProtocolError, match="a task must be a map, got list"):
        decode(encode(Msg.RUN, {"tasks": [[7, "noop"]]}))


@given(st.sampled_from(["lane", "report_key", "trace_key"]), _NOT_A_NAME)
def test_a_lane_or_key_that_is_no_string_rejects_its_task_alone(field, bad):
    _rejected_alone(_body(**{field: bad}), field)


@given(st.sampled_from([
    ({"inputs": [[1]]}, "input"), ({"inputs": ["x"]}, "input"), ({"inputs": [1.5]}, "input"),
    ({"inputs": [{"gather": 3}]}, "input"), ({"outputs": ["x"]}, "outputs"),
    ({"outputs": [-3]}, "outputs"), ({"outputs": [True]}, "outputs"),
    ({"stream": 1}, "stream"), ({"stream": True, "outputs": [3, 4]}, "stream"),
]))
def test_a_malformed_input_output_or_stream_flag_rejects_its_task_alone(case):
    changes, field = case
    _rejected_alone(_body(**changes), field)


def _rejected_alone(body: dict, field: str) -> None:
    with pytest.raises(MalformedTask, match=field) as raised:
        TaskSpec.decode(body)
    assert raised.value.task_id == 7
    good, rejected = decode_tasks([_body(id=6), body])
    assert good == TaskSpec("noop", {}, [1, [2, 0]], [3], 6)
    assert rejected == RejectedTask(7, str(raised.value))


# -- batched tasks [Note: batched tasks] ------------------------------------------------------
@st.composite
def batched_specs(draw) -> TaskSpec:
    items = draw(st.integers(1, 6))
    per_item_refs = draw(st.lists(st.lists(refs, min_size=items, max_size=items), min_size=1,
                                  max_size=3))
    shared = draw(st.lists(refs, max_size=2))
    inputs = [{"gather": r} for r in per_item_refs] + shared
    order = draw(st.permutations(range(len(inputs))))
    inputs = [inputs[j] for j in order]
    per_item = tuple(order.index(j) for j in range(len(per_item_refs)))
    outputs = draw(st.lists(ids, min_size=items * draw(st.integers(0, 2)),
                            max_size=items * 2).filter(lambda o: len(o) % items == 0))
    return TaskSpec(draw(names), draw(configs), inputs, outputs, draw(ids),
                    draw(st.none() | names), items=items, per_item=per_item)


@given(batched_specs())
def test_any_valid_batched_task_survives_the_round_trip(spec):
    assert _sent(spec) == [spec]


def _batched(**changes) -> dict:
    batch = {"inputs": [{"gather": [1, [2, 0]]}, 5], "outputs": [3, 4], "items": 2,
             "per_item": [0]}
    return _body(**{**batch, **changes})


def test_a_batched_body_decodes():
    spec = TaskSpec.decode(_batched())
    assert (spec.items, spec.per_item, spec.outputs) == (2, (0,), [3, 4])


@pytest.mark.parametrize(("changes", "field"), [
    ({"items": 0}, "items"), ({"items": "2"}, "items"), ({"items": 10**6}, "items"),
    ({"items": True}, "items"), ({"items": _DROP}, "items"),
    ({"outputs": [3, 4, 5]}, "multiple of 2"), ({"stream": True, "outputs": [3]}, "stream"),
    ({"per_item": []}, "per_item"), ({"per_item": [0, 0]}, "per_item"),
    ({"per_item": [2]}, "per_item"), ({"per_item": [1]}, "per_item input 1"),
    ({"per_item": "0"}, "per_item"), ({"per_item": _DROP}, "per_item"),
    ({"inputs": [{"gather": [1, 2, 3]}], "per_item": [0]}, "one ref per item"),
])
def test_a_malformed_batched_task_is_rejected_alone(changes, field):
    _rejected_alone(_batched(**changes), field)
