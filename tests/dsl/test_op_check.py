"""An @op's `check`: a call's config is checked when the flow is validated, a ValueError becoming
that call's one problem; a config key still missing is reported once, not checked."""

from __future__ import annotations

import pytest

from flowkit.dsl import Flow, FlowError, Stream, op

SEEN: list[dict] = []


def _positive(config: dict) -> None:
    SEEN.append(dict(config))
    if config["count"] < 1:
        raise ValueError(f"count={config['count']} asks for no items: give count >= 1")


@op(check=_positive)
def numbers(*, count: int = 3, start: int) -> Stream[int]:
    yield from range(start, start + count)


def test_a_check_sees_the_whole_config_and_its_error_is_the_calls_problem():
    SEEN.clear()
    with Flow("good"):
        numbers(start=2)
    assert SEEN == [{"count": 3, "start": 2}]
    with pytest.raises(FlowError) as raised, Flow("bad"):
        numbers(start=2, count=0, name="none")
    (problem,) = raised.value.problems
    assert (problem.rule, problem.op) == ("bad-config", "none")
    assert problem.message == "count=0 asks for no items: give count >= 1"


def test_a_missing_config_key_is_reported_once_and_not_checked():
    SEEN.clear()
    with pytest.raises(FlowError) as raised, Flow("missing"):
        numbers(count=0)
    assert [p.rule for p in raised.value.problems] == ["missing-config"] and SEEN == []


def test_a_config_changed_after_the_build_is_checked_at_validation():
    with Flow("later") as flow:
        numbers(start=0)
    next(iter(flow.nodes.values())).config["count"] = -1
    with pytest.raises(FlowError, match="count=-1"):
        flow.validate()
