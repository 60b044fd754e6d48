"""Partial rollouts' call policy [Note: partial rollouts in flowkit/runner/partial.py]: a step
calls `take` of its own prompts while the step before still generates, the rest in the places
its carried calls leave once it has handed them over; carried calls are called as they come, or
passed on unrun once the step has taken its groups. Then, on simulator executors, the order in
which the spans of consecutive steps' generation ran."""

from __future__ import annotations

import json

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowkit.dsl import Resumable
from flowkit.runner.partial import Carried, CarryOver, PartialCalls, PartialRollouts
from tests.cli.runs import GRPO
from tests.cli.runs import run_ok as _run

RESUMABLE = Resumable(abort_op="generation", take="take", request="request",
                      version_floor="min_version")


@attrs.define
class _Before:
    """The step before, as the ledger sees it."""

    closed: bool = False

    def node_closed(self, name: str) -> bool:
        return self.closed


@attrs.define
class _Site:
    prompts: list
    submitted: list = attrs.field(factory=list)

    def submit(self, lineage, lead, *, extra=None, meta=None) -> None:
        self.submitted.append(lineage)

    def abort(self, requests):
        return []

    def lead_items(self):
        return [(lineage, f"ref{lineage}") for lineage in self.prompts]

    def touch(self) -> None:
        pass


def _policy(take: int, prompts: int, before: _Before | None, *,
            drop_stale: bool = False) -> PartialCalls:
    ledger = CarryOver({0: before} if before is not None else {})
    return PartialCalls("generate", 1, PartialRollouts(take, 4, RESUMABLE, drop_stale=drop_stale),
                        ledger, "r:1", 0)


def _own(policy: PartialCalls, site: _Site) -> list:
    """What the step does with its own prompts as they arrive: the ones called now."""
    policy.submit(site, True)
    return [lineage for lineage in site.prompts if policy.admit(len(site.prompts), lineage)]


def test_take_own_prompts_go_while_the_step_before_generates_the_rest_wait_for_its_handover():
    before = _Before()
    policy, site = _policy(4, 6, before), _Site([(i,) for i in range(6)])
    assert _own(policy, site) == [(0,), (1,), (2,), (3,)]
    assert not policy.may_close()  # two prompts wait to know how many the carried calls take
    before.closed = True
    policy.receive([Carried(0, (9,), "c9")], closed=False)  # one carried call, not two
    policy.submit(site, True)
    # the carried call, and one own prompt in the place it left
    assert site.submitted == [("carried", 0, 9), (4,)]
    assert policy.may_close() and (policy.own, policy.unused) == (5, 1)


@given(take=st.integers(1, 6), extra=st.integers(0, 6), carried=st.integers(0, 6),
       early=st.booleans())
def test_a_step_never_runs_more_calls_than_its_prompts(take, extra, carried, early):
    """Whether the carried calls come before the step's prompts or after, a step runs its
    carried calls and its own prompts up to the number of prompts, and every prompt is called
    or counted unused."""
    prompts = take + extra
    carried = min(carried, extra)  # the step before carries at most prompts - take
    before = _Before(closed=early)
    policy, site = _policy(take, prompts, before), _Site([(i,) for i in range(prompts)])
    calls = [Carried(0, (100 + i,), None) for i in range(carried)]
    if early:
        policy.receive(calls, closed=False)
    own_now = _own(policy, site)
    if not early:
        assert len(own_now) == min(take, prompts)
        before.closed = True
        policy.receive(calls, closed=False)
        policy.submit(site, True)
    assert policy.own + len(policy.incoming) == prompts
    assert policy.own + policy.unused == prompts and policy.may_close()
    assert len(set(own_now + site.submitted)) == prompts


@given(take=st.integers(1, 6), extra=st.integers(0, 6), carried=st.integers(0, 6),
       early=st.booleans())
def test_where_stale_groups_drop_own_prompts_all_go_at_once_and_carried_calls_beside_them(
        take, extra, carried, early):
    # [Note: own prompts first]: no own prompt waits for the step before's handover
    prompts = take + extra
    carried = min(carried, extra)
    before = _Before(closed=early)
    policy = _policy(take, prompts, before, drop_stale=True)
    site = _Site([(i,) for i in range(prompts)])
    calls = [Carried(0, (100 + i,), None) for i in range(carried)]
    if early:
        policy.receive(calls, closed=False)
    assert _own(policy, site) == site.prompts and policy.may_close() == early
    before.closed = True
    policy.receive([] if early else calls, closed=False)
    policy.submit(site, True)
    assert site.submitted == [("carried", 0, 100 + i) for i in range(carried)]
    assert (policy.own, policy.unused, len(policy.incoming)) == (prompts, 0, carried)
    assert policy.may_close()


@given(take=st.integers(1, 6), extra=st.integers(0, 6), carried=st.integers(0, 6))
def test_where_stale_groups_drop_a_step_carries_at_most_prompts_less_take_and_none_twice(
        take, extra, carried):
    prompts = take + extra
    carried = min(carried, extra)
    policy = _policy(take, prompts, _Before(closed=True), drop_stale=True)
    site = _Site([(i,) for i in range(prompts)])
    policy.receive([Carried(0, (100 + i,), None) for i in range(carried)], closed=False)
    own = _own(policy, site)
    calls = [("carried", 0, 100 + i) for i in range(carried)] + own
    for lineage in calls:
        policy.config(lineage)
    for lineage in calls[::-1]:  # own prompts end first, then the carried ones
        policy.done(lineage, object(), site)
    metrics = policy.metrics(1.0)
    assert len(policy.outgoing) <= prompts - take
    assert all(c.lineage[0] != "carried" and c.origin == 1 for c in policy.outgoing)
    # the books: what started or came in is trained, dropped or carried on
    assert (metrics["rollout/started"] + metrics["rollout/resumed"]
            == 4 * take + metrics["rollout/dropped"] + metrics["rollout/carried_over"])


def test_with_drop_own_prompts_left_when_the_step_has_its_groups_are_unused():
    policy, site = _policy(2, 3, _Before(), drop_stale=True), _Site([(0,), (1,), (2,)])
    assert [policy.admit(3, (i,)) for i in range(2)] == [True, True]
    policy.config((0,)), policy.config((1,))
    policy.done((0,), object(), site)
    policy.done((1,), object(), site)
    assert policy.aborting and not policy.admit(3, (2,))
    assert policy.metrics(1.0)["rollout/prompts_unused"] == 1


def test_carried_calls_pass_on_unrun_once_the_step_has_taken_its_groups():
    before = _Before()
    policy, site = _policy(2, 3, before), _Site([(i,) for i in range(3)])
    assert _own(policy, site) == [(0,), (1,)]
    policy.config((0,)), policy.config((1,))
    policy.done((0,), object(), site)
    policy.done((1,), object(), site)  # the step's two groups: it aborts nothing left
    assert policy.aborting
    before.closed = True
    policy.receive([Carried(0, (9,), "c9")], closed=False)
    policy.submit(site, True)
    assert site.submitted == []  # neither the carried call nor the deferred prompt ran
    metrics = policy.metrics(1.0)
    assert metrics["rollout/passed_on"] == 4 and metrics["rollout/resumed"] == 4
    assert metrics["rollout/carried_over"] == 4 and metrics["rollout/prompts_unused"] == 1


@pytest.mark.slow
def test_consecutive_steps_generation_overlaps_with_partial_rollouts(tmp_path):
    """A step's own prompts start while the step before is still generating: some span of step
    s + 1's generation begins before the last of step s's ends."""
    flow = tmp_path / "partial.py"
    flow.write_text(open(GRPO).read().replace(
        "source_config={\"digits\": 3})", "source_config={\"digits\": 3}, oversample=2.0)"))
    trace = tmp_path / "t.json"
    _run(str(flow), "--executors", "sim", "--steps", "4", "--max-staleness", "2",
         "--sim-cost", "token=0.002", "--trace", str(trace))
    spans = [e for e in json.loads(trace.read_text())["traceEvents"]
             if e["ph"] == "X" and e["args"].get("node") == "generate"]
    starts, ends = {}, {}
    for span in spans:
        step = span["args"]["step"]
        starts[step] = min(starts.get(step, span["ts"]), span["ts"])
        ends[step] = max(ends.get(step, 0), span["ts"] + span["dur"])
    assert any(starts[step + 1] < ends[step] for step in range(3))
