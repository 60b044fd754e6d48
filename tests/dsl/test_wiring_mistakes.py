"""Wiring mistakes a new user makes: each is reported once, where it happened, without the
follow-on errors it would otherwise cause."""

from __future__ import annotations

import pytest

from flowkit.dsl import Flow, FlowError, Stream, op
from tests.dsl.shapes import Generate, Prompt, Rollout, prompts, rules_of, score, wired


@op
def src() -> Stream[Rollout]:
    yield from ()


@op
def pair(x: Rollout, y: Rollout) -> Rollout:
    return x


def test_an_op_joins_the_active_flow_and_a_ref_from_another_flow_is_reported():
    with Flow("one") as f1:
        s = src()
    with pytest.raises(FlowError) as raised:
        with Flow("two") as flow:
            src(name="other")
            score(s)
    assert set(f1.nodes) == {"src"}  # nothing leaked into the earlier flow
    assert set(flow.nodes) == {"other", "score"}
    (problem,) = raised.value.problems  # and no unbound-input on top of it
    assert (problem.rule, problem.op, problem.port) == ("foreign-ref", "score", "rollout")
    assert "'one'" in problem.message and "'two'" in problem.message


def test_refs_from_two_flows_outside_any_with_block_are_reported():
    one, two = Flow("one"), Flow("two")
    with one:
        a = src()
    with two:
        b = src()
    pair(a, b)  # no active flow: the op joins its first input's flow
    assert "pair" in one.nodes and "pair" not in two.nodes
    problems = [p for p in one.check() if p.rule == "foreign-ref"]
    assert [(p.op, p.port) for p in problems] == [("pair", "y")]
    assert "unbound-input" not in rules_of(one)


def test_connect_with_a_malformed_port_is_a_problem_not_an_exception():
    flow = wired([src, score], ("garbage", "score.rollout"), ("src.out", "f"))
    problems = flow.check()
    assert [p.rule for p in problems] == ["bad-port-ref", "bad-port-ref"]
    assert (problems[0].op, problems[0].port) == ("score", "rollout")
    assert "'garbage'" in problems[0].message and "'f'" in problems[1].message


def test_an_input_given_positionally_and_by_keyword_is_reported():
    with pytest.raises(FlowError) as raised:
        with Flow("f"):
            a = src()
            pair(a, x=a, y=a)
    (problem,) = raised.value.problems
    assert (problem.rule, problem.op, problem.port) == ("input-given-twice", "pair", "x")


def _score_called_thrice(last_name: str | None = None) -> FlowError:
    with pytest.raises(FlowError) as raised:
        with Flow("f"):
            s = src()
            score(s)
            score(s)
            score(s, name=last_name)
    return raised.value


def test_an_op_called_three_times_gives_one_duplicate_problem_listing_the_calls():
    error = _score_called_thrice()
    text = str(error)
    assert "~" not in text
    (problem,) = [p for p in error.problems if p.rule == "duplicate-name"]
    assert problem.op == "score" and "3 ops are named 'score'" in problem.message
    assert problem.message.count("score(rollout=src.out) at test_wiring_mistakes.py:") == 3
    assert "name='score_2'" in problem.fix and "name='score_3'" in problem.fix


def test_suggested_names_are_not_already_taken():
    (problem,) = [p for p in _score_called_thrice("score_2").problems
                  if p.rule == "duplicate-name"]
    assert "name='score_3'" in problem.fix and "name='score_2'" not in problem.fix


def test_problems_of_a_duplicate_name_the_name_the_user_gave():
    flow = wired([score, score])
    problems = flow.check()
    assert [p.rule for p in problems] == ["duplicate-name", "unbound-input", "unbound-input"]
    assert {p.op for p in problems} == {"score"}


def test_a_broken_declaration_does_not_also_give_too_many_inputs():
    @op
    def half_typed(x, y: Rollout) -> Rollout:
        return y

    @op
    def variadic(*xs: Rollout) -> Rollout:
        return xs[0]

    with pytest.raises(FlowError) as raised:
        with Flow("f"):
            a = src()
            half_typed(a, a)
            variadic(a, a)
    rules = [p.rule for p in raised.value.problems]
    assert rules == ["missing-annotation", "bad-signature"]


def test_positional_inputs_bind_past_a_broken_parameter():
    @op
    def half_typed(x, y: Stream[Prompt]) -> Rollout:
        return y

    flow = Flow("f")
    with pytest.raises(FlowError) as raised:
        with flow:
            half_typed(src(), prompts())
    assert [p.rule for p in raised.value.problems] == ["missing-annotation"]
    assert [w.src for w in flow.wires if w.dst == "half_typed"] == ["prompts"]


def test_a_plain_value_is_not_also_an_unbound_input():
    with pytest.raises(FlowError) as raised:
        with Flow("f"):
            score(3)
    assert [p.rule for p in raised.value.problems] == ["not-a-ref"]


def test_a_wire_from_a_missing_op_is_not_a_second_producer():
    flow = wired([src, score], ("src.out", "score.rollout"), ("nope.out", "score.rollout"),
                 ("src.nope", "score.rollout"))
    assert rules_of(flow) == ["unknown-op", "unknown-port"]


def test_model_ops_keep_their_port_order(actor):
    with Flow("f") as flow:
        Generate(actor)(prompts())
    assert flow.check() == []
    assert Generate(actor).positional == ("prompts",)


@op
def both(x: Rollout, scores: Rollout) -> Rollout:
    return x


@op
def rescore(x: Rollout) -> Rollout:
    return x


def test_a_cycle_names_the_port_of_the_wire_that_closes_it():
    flow = wired([src, both, (rescore, "score")], ("src.out", "both.x"), ("both.out", "score.x"),
                 ("score.out", "both.scores"))
    (problem,) = flow.check()
    assert (problem.rule, problem.op, problem.port) == ("cycle", "both", "scores")
    assert "both.out -> score.x, score.out -> both.scores" in problem.message
    assert "op 'both', port 'scores'" in str(problem)
    assert "flow.feedback('scores'" in problem.fix and "both's 'scores' input" in problem.fix
    assert "fb.bind(<score's 'out' output>)" in problem.fix


def test_a_self_loop_is_a_cycle_at_its_port():
    flow = wired([(rescore, "loop")], ("loop.out", "loop.x"))
    (problem,) = flow.check()
    assert (problem.rule, problem.op, problem.port) == ("cycle", "loop", "x")
    assert "loop.out -> loop.x" in problem.message


def test_the_suggested_feedback_clears_the_cycle():
    with Flow("f") as flow:
        scores = flow.feedback("scores", Stream[Rollout])
        out = rescore(both(src(), scores), name="score")
        scores.bind(out)
    assert flow.check() == []


def test_a_feedback_declared_and_never_used_says_so():
    with pytest.raises(FlowError) as raised:
        with Flow("f") as flow:
            flow.feedback("state", Rollout)
            score(src())
    (problem,) = raised.value.problems
    assert problem.rule == "unbound-feedback"
    assert "declared but neither consumed nor bound" in problem.message
    assert "consumed but never bound" not in problem.message


def test_a_feedback_consumed_and_never_bound_names_its_consumer():
    with pytest.raises(FlowError) as raised:
        with Flow("f") as flow:
            both(src(), flow.feedback("state", Rollout))
    (problem,) = raised.value.problems
    assert (problem.rule, problem.op, problem.port) == ("unbound-feedback", "both", "scores")
    assert "consumed (by both.scores) but never bound" in problem.message
    assert "state.bind(" in problem.fix


def _fed_back_prompts(declared: type):
    """The one problem of feeding prompts back, through a feedback declared of type `declared`,
    into both's scores (a Rollout input)."""
    with pytest.raises(FlowError) as raised:
        with Flow("f") as flow:
            state = flow.feedback("state", declared)
            state.bind(prompts())
            both(src(), state)
    (problem,) = raised.value.problems
    return problem


def test_a_feedback_bound_to_the_wrong_type_is_reported_once_at_the_bind():
    problem = _fed_back_prompts(Rollout)
    assert (problem.rule, problem.op, problem.port) == ("type-mismatch", "prompts", "out")
    assert "feedback 'state'" in problem.message


def test_a_feedback_passed_to_an_input_of_another_type_is_reported_at_that_input():
    problem = _fed_back_prompts(Prompt)
    assert (problem.rule, problem.op, problem.port) == ("type-mismatch", "both", "scores")
    assert "from feedback 'state'" in problem.message
    assert "flow.feedback('state'" in problem.fix
