"""Each validation rule, and that a flow reports all of its problems in one FlowError."""

from __future__ import annotations

import pytest

from flowkit.dsl import Batch, Flow, FlowError, Model, Stream, collect, group_by, op
from tests.dsl import shapes
from tests.dsl.shapes import Generate, Prompt, Rollout, Scored, advantages, prompts, score, train


def _only(flow: Flow, rule: str):
    problems = [p for p in flow.check() if p.rule == rule]
    assert len(problems) == 1, flow.check()
    return problems[0]


def test_a_well_formed_grpo_step_is_valid(actor):
    flow = shapes.grpo_step(actor)
    assert flow.check() == []
    assert set(flow.graph.nodes) == {"prompts", "generate", "score", "advantages", "train"}
    wires = flow.graph.edges["advantages", "train"]["wires"]
    assert [str(w.adapter) for w in wires] == ["collect"]
    assert flow.nodes["generate"].config == {"n": 4, "temperature": 1.0}


def test_leaving_the_with_block_raises_every_problem_at_once(actor):
    with pytest.raises(FlowError) as raised:
        with Flow("bad"):
            p = prompts()
            score(p)  # type mismatch: Prompt is not a Rollout
            Generate(actor)(p, temprature=0.5)  # unknown config
            adv = advantages(score(Generate(actor, name="gen2")(p)), name="adv")  # no group_by
            train(adv)  # Stream into Batch without collect
    error = raised.value
    rules = [p.rule for p in error.problems]
    assert rules.count("type-mismatch") == 1
    assert {"unknown-config", "missing-group-by", "missing-collect"} <= set(rules)
    assert str(error).startswith(f"flow 'bad' has {len(rules)} errors:")
    for problem in error.problems:
        assert problem.op is not None, problem


def test_type_mismatch_names_op_port_expected_and_found():
    flow = shapes.wired([prompts, score], ("prompts.out", "score.rollout"))
    problem = _only(flow, "type-mismatch")
    assert (problem.op, problem.port) == ("score", "rollout")
    assert problem.expected == "Stream[Rollout]"
    assert "Stream[Prompt]" in problem.found and "prompts.out" in problem.found
    assert "Prompt is not Rollout" in problem.message


def test_subclass_records_flow_into_base_ports():
    @op
    def keep(rollout: Rollout) -> Rollout:
        return rollout

    @op
    def scored_source() -> Stream[Scored]:
        yield from ()

    flow = Flow("f")
    with flow:
        keep(scored_source())
    assert flow.check() == []


def test_unbound_input_is_reported_with_how_to_wire_it():
    flow = shapes.wired([score])
    problem = _only(flow, "unbound-input")
    assert (problem.op, problem.port) == ("score", "rollout")
    assert "flow.connect" in problem.fix


def test_optional_inputs_may_stay_unwired():
    @op
    def maybe(rollout: Rollout | None = None) -> float:
        return 0.0

    flow = shapes.wired([maybe])
    assert flow.check() == []


def test_stream_into_batch_needs_collect_and_collect_makes_the_barrier_visible():
    flow = shapes.wired([prompts, train], ("prompts.out", "train.batch"))
    rules = shapes.rules_of(flow)
    assert "missing-collect" in rules
    problem = _only(flow, "missing-collect")
    assert "collect(" in problem.fix and problem.op == "train"


def test_collect_into_a_stream_port_is_a_useless_barrier():
    @op
    def each(rollout: Rollout) -> float:
        return 0.0

    @op
    def source() -> Stream[Rollout]:
        yield from ()

    flow = Flow("f")
    with pytest.raises(FlowError, match="useless-collect"):
        with flow:
            each(collect(source()))


def test_group_by_key_must_be_a_record_field(actor):
    flow = Flow("f")
    with pytest.raises(FlowError) as raised:
        with flow:
            advantages(group_by(score(Generate(actor)(prompts())), key="prompt", size=4))
    (problem,) = raised.value.problems
    assert problem.rule == "unknown-group-key"
    assert "prompt_id" in problem.fix


def test_a_cycle_within_a_step_is_reported_and_a_feedback_edge_is_not():
    flow = shapes.wired([(shapes.step, "a"), (shapes.step, "b")], ("a.out", "b.x"),
                        ("b.out", "a.x"))
    problem = _only(flow, "cycle")
    assert "a -> b -> a" in problem.message or "b -> a -> b" in problem.message
    assert "feedback" in problem.fix

    with Flow("loop") as loop:
        carried = loop.feedback("state", float)
        out = shapes.step(shapes.step(carried, name="a"), name="b")
        carried.bind(out)
    assert loop.check() == []
    assert [w.feedback for w in loop.wires] == [False, True]


def test_unbound_feedback_is_reported():
    flow = Flow("f")
    with pytest.raises(FlowError, match="unbound-feedback"):
        with flow:
            shapes.step(flow.feedback("state", float))


def test_feedback_bound_to_the_wrong_type_is_reported():
    @op
    def step(x: float) -> str:
        return str(x)

    flow = Flow("f")
    with pytest.raises(FlowError, match="type-mismatch"):
        with flow:
            state = flow.feedback("state", float)
            state.bind(step(state))


def test_duplicate_op_names_are_reported_and_both_ops_still_checked(actor):
    flow = Flow("f")
    with pytest.raises(FlowError) as raised:
        with flow:
            source = prompts()
            score(source)
            score(source)
    rules = [p.rule for p in raised.value.problems]
    assert rules.count("duplicate-name") == 1
    assert rules.count("type-mismatch") == 2  # the renamed duplicate is still validated


def test_unique_names_make_repeated_ops_fine(actor):
    with Flow("f") as flow:
        rollouts = Generate(actor)(prompts())
        score(rollouts, name="score_a")
        score(rollouts, name="score_b")
    assert flow.check() == []


def test_unknown_model_reference_suggests_the_declared_one(actor):
    flow = Flow("f")
    flow.add_model(actor)
    with pytest.raises(FlowError) as raised:
        with flow:
            score(Generate("actr")(prompts()))
    (problem,) = raised.value.problems
    assert problem.rule == "unknown-model" and problem.op == "generate"
    assert "did you mean 'actor'" in problem.fix


def test_ops_on_the_same_model_share_it(actor):
    with Flow("f") as flow:
        rollouts = Generate(actor)(prompts())
        Generate("actor", name="again")(prompts(name="more"))
        score(rollouts)
    assert list(flow.models) == ["actor"]
    assert {n.model for n in flow.nodes.values() if n.model} == {"actor"}


def test_two_different_models_with_one_name_are_reported(actor):
    other = Model(name="actor", build="pkg.models:other")
    flow = Flow("f")
    with pytest.raises(FlowError, match="two different models are named 'actor'"):
        with flow:
            Generate(actor)(prompts())
            Generate(other, name="gen2")(prompts(name="p2"))


def test_missing_annotations_are_reported_when_the_flow_is_built():
    @op
    def untyped(rollout):
        return rollout

    flow = shapes.wired([untyped])
    rules = shapes.rules_of(flow)
    assert rules.count("missing-annotation") == 2  # the input and the return


def test_plain_values_and_extra_positional_inputs_are_reported():
    flow = Flow("f")
    with pytest.raises(FlowError) as raised:
        with flow:
            score(3)
            score(prompts(), prompts(name="p2"), name="s2")
    rules = [p.rule for p in raised.value.problems]
    assert "not-a-ref" in rules and "too-many-inputs" in rules


def test_an_input_with_two_producers_is_reported():
    flow = shapes.wired([(prompts, "a"), (prompts, "b"), train], ("a.out", "train.batch"),
                        ("b.out", "train.batch"))
    assert "input-wired-twice" in shapes.rules_of(flow)


def test_wires_to_unknown_ops_and_ports_suggest_the_known_ones():
    flow = shapes.wired([prompts, score], ("prompts.output", "score.rollout"),
                 ("prompts.out", "scor.rollout"))
    problems = flow.check()
    assert any(p.rule == "unknown-port" and "did you mean 'out'" in p.fix for p in problems)
    assert any(p.rule == "unknown-op" and "did you mean 'score'" in p.fix for p in problems)


def test_missing_required_config_is_reported():
    @op
    def sample(rollout: Rollout, *, k: int) -> Rollout:
        return rollout

    flow = Flow("f")
    with pytest.raises(FlowError, match="missing-config"):
        with flow:
            sample(Generate(Model(name="m", build="a:b"))(prompts()))


def test_an_empty_flow_is_an_error():
    with pytest.raises(FlowError, match="no operators"):
        with Flow("empty"):
            pass


def test_calling_an_op_outside_a_flow_says_how_to_fix_it():
    with pytest.raises(RuntimeError, match="with Flow"):
        prompts()


def test_multiple_outputs_unpack_and_read_by_name():
    @op(outputs={"good": Stream[Scored], "bad": Stream[Scored]})
    def split(scored: Scored):
        return {"good": scored} if scored.reward > 0 else {"bad": scored}

    @op
    def sink(batch: Batch[Scored]) -> None:
        return None

    with Flow("f") as flow:
        good, bad = split(score(Generate(Model(name="m", build="a:b"))(prompts())))
        sink(collect(good), name="g")
        sink(collect(bad), name="b")
    assert {w.src_port for w in flow.wires if w.src == "split"} == {"good", "bad"}
    assert str(good) == "split.good"


def test_prompt_type_is_used_by_model_ops(actor):
    assert Generate(actor).inputs["prompts"].type.item is Prompt
