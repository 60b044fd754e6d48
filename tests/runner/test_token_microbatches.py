"""Token-budget microbatches [Note: token-budget microbatches in
flowkit/runner/token_microbatches.py]: bins hold every item once within the budget (a longer
item alone), a streamed microbatch forms once a budget fills, replicas are given microbatches
by tokens, and too small a budget is refused in one line before the run."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowkit.runner.feeding import token_bins
from flowkit.runner.token_microbatches import (
    TokenSlots,
    fill_one,
    first_fit_decreasing,
    planned_count,
)

SIZES = st.lists(st.integers(1, 300), max_size=40)


@settings(max_examples=80, deadline=None)
@given(SIZES, st.integers(16, 512))
def test_bins_hold_every_item_once_within_the_budget(sizes, budget):
    tokens = dict(enumerate(sizes))
    bins = first_fit_decreasing(list(tokens), tokens, budget)
    assert sorted(i for b in bins for i in b) == list(tokens)
    for b in bins:
        assert len(b) == 1 or sum(tokens[i] for i in b) <= budget
    # first fit: no two bins could have been one
    loads = sorted(sum(tokens[i] for i in b) for b in bins)
    assert len(loads) < 2 or loads[0] + loads[1] > budget


@settings(max_examples=80, deadline=None)
@given(SIZES, st.integers(1, 4), st.integers(1, 3), st.lists(st.integers(0, 900), max_size=4))
def test_the_close_evens_out_the_replicas_totals_not_the_microbatches(sizes, replicas, each,
                                                                      given_before):
    """Whatever the replicas were given before, every item goes, largest first, to the replica
    with the fewest tokens: where they started even, they end within one item (LPT's bound);
    else the lighter ones are filled first."""
    tokens = dict(enumerate(sizes))
    slots = TokenSlots.of(replicas * each, replicas)
    before = (given_before + [0] * replicas)[:replicas]
    slots.tokens = list(before)
    placed = slots.place(list(tokens), tokens)
    assert sorted(g for g, _ in placed) == list(range(replicas * each)) and slots.left == 0
    assert sorted(i for _, b in placed for i in b) == list(tokens)
    loads = [sum(tokens[i] for i in b) for _, b in placed]
    assert loads == sorted(loads, reverse=True)  # the heaviest first
    totals = [before[r] + sum(tokens[i] for g, b in placed if g % replicas == r for i in b)
              for r in range(replicas)]
    assert totals == slots.tokens
    if len(set(before)) == 1:
        assert max(totals) - min(totals) <= max(sizes, default=0)
    else:  # a replica given an item ends at most one item above the lightest
        gained = [t - b for t, b in zip(totals, before)]
        assert all(t <= min(totals) + max(sizes, default=0) for t, g in zip(totals, gained) if g)


def test_a_streamed_microbatch_leaves_each_replica_its_last_slot_for_the_close():
    slots = TokenSlots.of(4, 2)  # replica 0 runs 0, 2; replica 1 runs 1, 3
    assert [slots.take(n, keep_last=True) for n in (500, 100)] == [0, 1]
    assert not slots.spare and slots.free == [[2], [3]]
    with pytest.raises(ValueError):
        slots.take(1, keep_last=True)
    tokens = {"a": 450, "b": 50}  # the close tops up the lighter replica first
    assert dict(slots.place(list(tokens), tokens)) == {3: ["a"], 2: ["b"]}
    assert slots.tokens == [550, 550]


def test_one_microbatch_takes_the_largest_that_fit():
    tokens = {"a": 300, "b": 200, "c": 120, "d": 90, "e": 700}
    assert fill_one(list(tokens), tokens, 512) == ["e"]  # longer than the budget: alone
    del tokens["e"]
    assert fill_one(list(tokens), tokens, 512) == ["a", "b"]
    assert fill_one(["c", "d"], tokens, 512) == ["c", "d"]


def test_replicas_are_given_microbatches_by_tokens():
    slots = TokenSlots.of(6, 2)  # replica 0 runs 0, 2, 4; replica 1 runs 1, 3, 5
    got = [slots.take(n) for n in (500, 480, 100, 90, 400, 410)]
    assert got == [0, 1, 3, 2, 5, 4]  # each to the lighter replica with a slot left
    assert slots.tokens == [1000, 980] and slots.left == 0
    with pytest.raises(ValueError):
        slots.take(1)


@settings(max_examples=60, deadline=None)
@given(SIZES, st.integers(64, 512), st.integers(1, 4))
def test_token_bins_fill_every_slot_and_balance_the_replicas(sizes, budget, replicas):
    tokens = dict(enumerate(sizes))
    count = planned_count(sum(sizes), budget, replicas)
    slots = TokenSlots.of(count, replicas)
    placed = token_bins(list(tokens), tokens, slots)
    assert sorted(g for g, _ in placed) == list(range(count)) and slots.left == 0
    assert sorted(i for _, b in placed for i in b) == list(tokens)
    per_replica = [sum(tokens[i] for g, b in placed if g % replicas == r for i in b)
                   for r in range(replicas)]
    heaviest = max((sum(tokens[i] for i in b) for _, b in placed), default=0)
    assert max(per_replica) - min(per_replica) <= heaviest


def test_a_streamed_step_plans_as_many_as_the_last_steps_tokens_fill():
    assert planned_count(5000, 1024, 1) == 5
    assert planned_count(5000, 1024, 2) == 6  # as many for each replica
    assert planned_count(100, 1024, 2) == 2  # one a replica at least


def test_too_small_a_budget_is_refused_before_the_run():
    from dataflows.grpo import grpo_flow
    from flowkit.runner.setup import with_training_options

    flow = grpo_flow(prompts=4, n=2, max_new_tokens=64)
    with pytest.raises(Exception, match=r"microbatch_tokens=32 is smaller than one sequence: a "
                       r"response of up to 64 tokens and its prompt"):
        with_training_options(flow, stages=None, microbatches=None, schedule=None,
                              microbatch_tokens=32)
    with_training_options(grpo_flow(prompts=4, n=2, max_new_tokens=64), stages=None,
                          microbatches=None, schedule=None, microbatch_tokens=65)


@pytest.mark.parametrize("carried", [{"update_actor": 300}, None])
def test_a_run_checkpoint_keeps_the_last_steps_tokens(tmp_path, carried):
    from flowkit.runner.checkpoints.controller_state import read_state
    from flowkit.runner.checkpoints.state_codec import allowed_records, encode_state

    training = {"item_counts": {"update_actor": 12}, "predicted_bubble": {},
                "last_schedule": None}
    if carried is not None:  # a file written before token counts has none
        training["token_counts"] = carried
    path = tmp_path / "state"
    path.write_bytes(encode_state({"step": 3, "records": [], "feedback": [],
                                   "training": {"actor": training}, "profiles": [],
                                   "open_work": None}))
    path.chmod(0o600)
    read = read_state(path, allowed_records())
    assert read.training["actor"]["token_counts"] == (carried or {})
    assert read.training["actor"]["item_counts"] == {"update_actor": 12}
