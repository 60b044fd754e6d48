"""Length-aware dispatch [Note: length-aware dispatch in flowkit/runner/balance.py]: the
estimates, the order, the assignment and the rank correlation, on constructed cases."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowkit.runner.balance import Balancer, LengthEstimates, rank_correlation

# prompts' lengths as a history taught them, in the order they were submitted: two long ones
# among short ones, where count-based dispatch (round robin) puts both long ones together
_SKEWED = {0: 400.0, 1: 20.0, 2: 380.0, 3: 30.0, 4: 10.0, 5: 25.0, 6: 15.0, 7: 20.0}


def _taught(lengths: dict) -> LengthEstimates:
    estimates = LengthEstimates()
    estimates.learn({key: [int(length)] for key, length in lengths.items()})
    return estimates


def _dispatch_by_work(lengths: dict, executors: int = 2) -> dict[int, float]:
    """Work per executor when predictions come true, the calls all ready at once."""
    balancer = Balancer(_taught(lengths), list(range(executors)), count=1, budget=512)
    work = dict.fromkeys(range(executors), 0.0)
    for lineage, key in balancer.order([((key,), key) for key in lengths]):
        work[balancer.assign(lineage, key)] += lengths[key]
    return work


def _dispatch_by_count(lengths: dict, executors: int = 2) -> dict[int, float]:
    """The dispatcher's least-outstanding choice with every call still open: round robin."""
    work = dict.fromkeys(range(executors), 0.0)
    for i, key in enumerate(lengths):
        work[i % executors] += lengths[key]
    return work


def test_predicted_work_balances_a_skewed_set_better_than_counting_calls():
    by_work, by_count = _dispatch_by_work(_SKEWED), _dispatch_by_count(_SKEWED)
    assert max(by_count.values()) == 805  # both long prompts on one executor
    assert max(by_work.values()) == 455  # one each, short ones filling up: even is 450
    assert sum(by_work.values()) == sum(by_count.values())


@given(st.lists(st.integers(1, 1000), min_size=1, max_size=30), st.integers(1, 4))
def test_greedy_longest_first_is_within_one_call_of_perfect_balance(lengths, executors):
    work = _dispatch_by_work(dict(enumerate(map(float, lengths))), executors)
    assert max(work.values()) <= sum(lengths) / executors + max(lengths)


def test_calls_go_longest_first_keeping_the_order_of_equals():
    balancer = Balancer(_taught({1: 50, 2: 300, 3: 50, 4: 120}), [0], count=4, budget=512)
    ready = [((k,), k) for k in (1, 2, 3, 4, 5)]  # 5: no history, the running mean (130)
    assert [key for _, key in balancer.order(ready)] == [2, 5, 4, 1, 3]


def test_an_estimate_comes_from_history_then_this_steps_group_then_the_mean_then_the_budget():
    estimates = LengthEstimates(alpha=0.5)
    assert estimates.estimate("a", budget=100) == (50.0, False)
    estimates.learn({"a": [10, 30]})
    assert estimates.estimate("a", budget=100) == (20.0, True)
    estimates.learn({"a": [40]})
    assert estimates.estimate("a", budget=100) == (30.0, True)  # 0.5 * 40 + 0.5 * 20
    assert estimates.estimate("b", budget=100, group=[5, 12]) == (12.0, False)
    assert estimates.estimate("b", budget=100) == (80 / 3, False)  # every length seen


def test_finished_items_raise_what_a_call_has_left_and_closing_clears_it():
    balancer = Balancer(LengthEstimates(), [0, 1], count=4, budget=100)
    first = balancer.assign(("a",), "a")  # 4 x 50 predicted
    balancer.finished(("a",), 90)  # 3 left, each at least 90: 270 open
    assert balancer.assign(("b",), "b") != first
    assert balancer.assign(("c",), "c") != first  # 200 + 200 < 270
    balancer.closed(("a",))
    assert balancer.assign(("d",), "d") == first


def test_the_step_reports_the_rank_correlation_of_the_calls_that_had_a_history():
    balancer = Balancer(_taught({1: 10, 2: 20, 3: 30}), [0, 1], count=2, budget=512)
    for key, sizes in {1: [5, 12], 2: [25, 18], 3: [40, 31], 9: [1, 500]}.items():
        balancer.assign((key,), key)
        for size in sizes:
            balancer.finished((key,), size)
    metrics = balancer.end_step("generate")
    # predicted 10, 10, 20, 20, 30, 30 against 5, 12, 25, 18, 40, 31 (prompt 9 had none)
    assert metrics["generate/length_rank_corr"] == pytest.approx(
        rank_correlation([10, 10, 20, 20, 30, 30], [5, 12, 25, 18, 40, 31]))
    # ranks by hand
    assert metrics["generate/length_rank_corr"] == pytest.approx(16 / (16 * 17.5) ** 0.5)
    assert balancer.estimates.estimate(9, budget=512) == (250.5, True)  # learned for next step


def test_rank_correlation_by_hand():
    assert rank_correlation([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert rank_correlation([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    # ties share their mean rank: x ranks 1.5, 1.5, 3 against y ranks 1, 2, 3
    assert rank_correlation([5, 5, 9], [1, 2, 3]) == pytest.approx(1.5 / (1.5 * 2) ** 0.5)
    assert rank_correlation([1], [1]) is None and rank_correlation([2, 2], [1, 3]) is None


# -- in a running flow -------------------------------------------------------------------------
def test_a_grpo_step_dispatches_prompts_longest_first_and_reports_the_rank_correlation(pool):
    from dataflows.grpo import grpo_flow
    from flowkit.planner.lower import lower_flow
    from flowkit.planner.simcosts import SimCosts
    from flowkit.runner.flowrun import FlowRunner

    flow = grpo_flow(prompts=8, n=4, stages=1, microbatches=2, max_new_tokens=64)
    costs = SimCosts(token=0.0002, length_sigma=1.0, prompt_sigma=1.0)
    tags = [("rollout",), ("rollout",), ("train",)]
    with pool.shared(3, kind="sim", tags=tags) as (ctl, executors):
        runner = FlowRunner(ctl, lower_flow(flow), sim_costs=costs)
        reports = [runner.run_step(step) for step in range(2)]
    assert "generate/length_rank_corr" not in reports[0].metrics  # no history yet
    assert -1 <= reports[1].metrics["generate/length_rank_corr"] <= 1
    assert reports[1].metrics["generate/work_imbalance"] >= 1
    calls = list(runner.balancers["generate"].calls.values())  # in the order they were sent
    assert len(calls) == 8 and all(call.history for call in calls)
    assert [c.per_item for c in calls] == sorted((c.per_item for c in calls), reverse=True)
    rollout = {e.id for e in executors if "rollout" in e.tags}
    assert {call.executor for call in calls} == rollout


# events on a step's calls: assign a new call, an item of call i finished at size s, close call i
_EVENTS = st.lists(st.one_of(
    st.tuples(st.just("assign"), st.integers(0, 5)),
    st.tuples(st.just("finished"), st.integers(0, 30), st.integers(1, 500)),
    st.tuples(st.just("closed"), st.integers(0, 30))), max_size=60)


@given(_EVENTS)
def test_the_open_work_kept_call_by_call_is_the_sum_over_the_calls(events):
    # assign() reads each executor's open work from running sums, never walking the step's
    # calls (which made a step's dispatch quadratic in its calls): they must stay the sums
    balancer = Balancer(_taught(_SKEWED), [0, 1, 2], count=4, budget=512)
    lineages: list[tuple] = []
    for event in events:
        if event[0] == "assign":
            lineages.append((len(lineages),))
            balancer.assign(lineages[-1], event[1])
        elif lineages:
            lineage = lineages[event[1] % len(lineages)]
            if event[0] == "finished":
                balancer.finished(lineage, event[2])
            else:
                balancer.closed(lineage)
        for executor in (0, 1, 2):
            calls = [c for c in balancer.calls.values() if c.executor == executor]
            assert balancer.load[executor] == pytest.approx(
                sum(c.remaining() for c in calls), abs=1e-6)
            assert balancer.open_calls[executor] == sum(c.open for c in calls)


def test_a_lent_executor_takes_calls_only_while_nothing_else_of_its_is_outstanding():
    """Executor 1 also trains (--placement multiplexed): while a training task of its is
    outstanding the calls go to executor 0 alone; idle, it takes its share; the calls this
    node sent it do not make it busy."""
    training = {0: 0, 1: 1}  # tasks outstanding besides generation
    balancer = Balancer(LengthEstimates(), [0, 1], count=1, budget=100, lent=frozenset({1}),
                        outstanding=lambda e: training[e] + balancer.open_calls[e])
    assert [balancer.assign((i,), None) for i in range(3)] == [0, 0, 0]
    training[1] = 0  # its training ended
    assert [balancer.assign((i,), None) for i in range(3, 6)] == [1, 1, 1]  # the least work
    training[0] = 5  # a dedicated executor is never skipped, however busy
    assert balancer.assign((6,), None) in (0, 1)


def test_without_a_dedicated_executor_the_lent_ones_take_every_call():
    balancer = Balancer(LengthEstimates(), [0, 1], count=1, budget=100, lent=frozenset({0, 1}),
                        outstanding=lambda e: 9)
    assert {balancer.assign((i,), None) for i in range(4)} == {0, 1}
