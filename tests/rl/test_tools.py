"""Tools for multi-turn rollouts (dataflows/tools.py): their JSON schemas are Hugging Face's, the
ToolEnvironment runs the calls a model writes in either format and turns every failure into an
observation, and the calculator evaluates integer arithmetic and nothing else."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dataflows.envs import GuessNumber
from dataflows.tools import ToolEnvironment, calculator, schema_of
from flowkit.ops.toolcalls import hermes_calls

CALC = ["dataflows.tools:calculator"]


def add(a: int, b: float = 1.0, note: str = "") -> float:
    """Add two numbers.

    Args:
        a: the first
        b: the second
        note: ignored
    """
    return a + b


def untyped(a):
    return a


@pytest.mark.parametrize("fn", [calculator, add])
def test_a_tools_schema_is_the_one_transformers_makes(fn):
    transformers = pytest.importorskip("transformers", reason="the hf extra")
    assert schema_of(fn) == transformers.utils.get_json_schema(fn)


def test_a_tool_without_type_hints_is_refused_naming_the_parameter():
    with pytest.raises(TypeError, match="parameter 'a' needs a type hint"):
        schema_of(untyped)
    with pytest.raises(ValueError, match="is not a function"):
        ToolEnvironment(["dataflows.tools:nothing_here"])


@given(a=st.integers(-10**6, 10**6), b=st.integers(-10**6, 10**6),
       op=st.sampled_from(["+", "-", "*"]))
def test_the_calculator_is_integer_arithmetic(a, b, op):
    assert calculator(f"{a}{op}({b})") == str(eval(f"{a}{op}({b})"))  # noqa: S307 (our ints)


@pytest.mark.parametrize("expression", ["__import__('os')", "2**99999", "1/2", "x+1", "9" * 201,
                                        "().__class__"])
def test_the_calculator_refuses_anything_else(expression):
    with pytest.raises((ValueError, SyntaxError)):
        calculator(expression)


def test_simple_calls_run_and_the_answer_ends_the_episode():
    env = ToolEnvironment(CALC)
    env.reset("123*45=", "5535")
    first = env.step("calculator(123*45)")
    assert first.observation == "5535" and first.info == {"tool_calls": 1, "tool_errors": 0}
    assert env.step("calculator(1//0)").observation.startswith("error: ZeroDivisionError")
    assert env.step("calc(2)").observation == "error: no tool 'calc'; the tools are calculator"
    assert env.step('calculator({"expression": "2*3"})').observation == "6"
    final = env.step(" 5535 ")
    assert final.done and final.reward == 1.0
    assert final.info == {"tool_calls": 4, "tool_errors": 2}
    env.reset("123*45=", "5535")
    assert env.step("5536").reward == 0.0


def test_hermes_calls_answer_inside_tool_response_tags():
    env = ToolEnvironment(CALC, call_format="hermes", last_number=True)
    env.reset("What is 3+4?", "7")
    step = env.step('Let me check. <tool_call>{"name": "calculator", "arguments": '
                    '{"expression": "3+4"}}</tool_call>')
    assert step.observation == "<tool_response>\n7\n</tool_response>" and not step.done
    assert env.step("<tool_call>not json</tool_call>").observation == (
        '<tool_response>\nerror: the call is not JSON {"name": ..., "arguments": {...}}\n'
        "</tool_response>")
    final = env.step("The answer is 7.")
    assert final.done and final.reward == 1.0


def test_a_bad_call_format_is_refused():
    with pytest.raises(ValueError, match="call_format='xml'"):
        ToolEnvironment(CALC, call_format="xml")


def test_a_tool_episode_restored_from_its_state_goes_on_as_the_original():
    env = ToolEnvironment(CALC)
    env.reset("123*45=", "5535")
    env.step("calculator(123*45)")
    env.step("calc(2)")
    state = env.state()
    assert json.loads(json.dumps(state)) == state
    again = ToolEnvironment(CALC)
    again.restore(state)  # no reset: the answer comes from the state
    assert again.step(" 5535 ") == env.step(" 5535 ")
    with pytest.raises(ValueError, match="not a ToolEnvironment's state"):
        ToolEnvironment(CALC).restore({"answer": 5, "calls": -1, "errors": 0})


def test_a_game_restored_from_its_state_goes_on_as_the_original():
    game = GuessNumber(low=1, high=8)
    game.reset("guess 1-8:", "6")
    game.step("3")
    again = GuessNumber(low=1, high=8)
    again.restore(json.loads(json.dumps(game.state())))
    assert [again.step(g) for g in ("7", "6")] == [game.step(g) for g in ("7", "6")]
    with pytest.raises(ValueError, match="secret is a number"):
        GuessNumber().restore({"secret": "6"})


def test_hermes_calls_are_read_back_as_calls_and_the_rest_as_text():
    text = ('Two checks. <tool_call>{"name": "calculator", "arguments": {"expression": "3+4"}}'
            '</tool_call> <tool_call>{"name": "calculator", "arguments": {"expression": "5"}}'
            '</tool_call>')
    content, calls = hermes_calls(text)
    assert content == "Two checks." and calls == [
        {"name": "calculator", "arguments": {"expression": "3+4"}},
        {"name": "calculator", "arguments": {"expression": "5"}}]
    # a block that is not a call stays as the model wrote it; no call: the text unchanged
    assert hermes_calls("a <tool_call>[1]</tool_call>") == ("a <tool_call>[1]</tool_call>", [])
    assert hermes_calls(" 7 ") == (" 7 ", [])
