"""Tools for multi-turn rollouts [Note: multi-turn rollouts in flowkit/ops/environments.py]:
plain functions with a JSON schema, and `ToolEnvironment`, which runs the ones a model calls.

A tool is a module-level function with type hints; `schema_of` makes its JSON schema (the
OpenAI / Hugging Face function format: name, description, parameters) from the signature and
the docstring, as a chat template's `tools=` takes it. A flow names its tools by import path:

    grpo_flow(environment="dataflows.tools:ToolEnvironment",
              env_config={"tools": ["dataflows.tools:calculator"], "call_format": "simple"},
              max_turns=3, reward=environment_reward, ...)

A model turn that calls a tool gets the tool's result as the environment's turn; a turn that
calls none is the final answer, which ends the episode, reward 1 when it is the prompt's answer
(stripped; `last_number=True`: its last number against the answer's). Call formats:

- "simple" (the built-in GPT on bytes): the whole turn is ``name(arguments)``: the one argument
  of a one-parameter tool as it stands (``calculator(123*45)``), else a JSON object;
- "hermes" (Qwen2.5 and other Hermes-style templates): ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`` anywhere in the turn; the result comes back as
  ``<tool_response>...</tool_response>``, as those templates render a tool message.

A call that names no tool, has arguments that do not fit, or raises gets "error: ..." as its
result (the model may try again) and counts in the step's info. Tools run in the environment's
thread, bounded by the flow's env_timeout_s; a tool that runs untrusted code (a program the
model wrote) runs it in dataflows.sandbox.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import operator
import re
from collections.abc import Callable
from typing import Any

from flowkit.ops import Environment, EnvStep
from flowkit.ops.toolcalls import HERMES_CALL

__all__ = ["ToolEnvironment", "calculator", "schema_of", "tool_function"]

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array",
               dict: "object"}
_SIMPLE = re.compile(r"^\s*([A-Za-z_]\w*)\((.*)\)\s*$", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
CALL_FORMATS = ("simple", "hermes")


def schema_of(fn: Callable[..., Any]) -> dict[str, Any]:
    """`fn`'s JSON schema: its name, its docstring's first paragraph, and a parameter for each
    argument, typed by its hint, required unless it has a default; an "Args:" section of the
    docstring describes them (``name: what it is``)."""
    hints = inspect.get_annotations(fn, eval_str=True)
    doc = inspect.getdoc(fn) or ""
    described = dict(re.findall(r"^\s+(\w+):\s*(.+)$", doc.partition("Args:")[2], re.MULTILINE))
    properties, required = {}, []
    for name, parameter in inspect.signature(fn).parameters.items():  # never "return"
        kind = _JSON_TYPES.get(hints.get(name))
        if kind is None:
            raise TypeError(f"tool {fn.__name__}: parameter {name!r} needs a type hint among "
                            f"{', '.join(t.__name__ for t in _JSON_TYPES)}")
        properties[name] = {"type": kind, **({"description": described[name]}
                                             if name in described else {})}
        if parameter.default is inspect.Parameter.empty:
            required.append(name)
    returns = _JSON_TYPES.get(hints.get("return"))
    return {"type": "function", "function": {
        "name": fn.__name__, "description": doc.partition("\n\n")[0].replace("\n", " "),
        "parameters": {"type": "object", "properties": properties, "required": required},
        **({"return": {"type": returns}} if returns else {})}}


class ToolEnvironment(Environment):
    """Runs the tools a model calls (`tools`: "module:function" names), as `call_format` writes
    calls; the final answer (a turn without a call) ends the episode, scored against the
    prompt's answer."""

    def __init__(self, tools: list[str], call_format: str = "simple",
                 last_number: bool = False) -> None:
        if call_format not in CALL_FORMATS:
            raise ValueError(f"call_format={call_format!r}: one of {', '.join(CALL_FORMATS)}")
        self.tools = {fn.__name__: fn for fn in map(tool_function, tools)}
        self.schemas = [schema_of(fn) for fn in self.tools.values()]
        self.call_format, self.last_number = call_format, last_number
        self.answer: str | None = None
        self.calls = self.errors = 0

    def reset(self, prompt: str, answer: str | None = None) -> None:
        self.answer = answer

    def step(self, action: str) -> EnvStep:
        call = self._call_in(action)
        if call is None:
            return EnvStep(reward=self._score(action), done=True, info=self._counts())
        self.calls += 1
        result = self._run(*call)
        if result.startswith("error:"):
            self.errors += 1
        if self.call_format == "hermes":
            result = f"<tool_response>\n{result}\n</tool_response>"
        return EnvStep(observation=result, info=self._counts())

    def state(self) -> dict:
        """The episode as plain data (the tools are the flow's settings): a trajectory cut
        between calls goes on elsewhere."""
        return {"answer": self.answer, "calls": self.calls, "errors": self.errors}

    def restore(self, state: dict) -> None:
        answer, calls, errors = state["answer"], state["calls"], state["errors"]
        if not (answer is None or isinstance(answer, str)) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0
                for n in (calls, errors)):
            raise ValueError(f"not a ToolEnvironment's state: {state!r}"[:200])
        self.answer, self.calls, self.errors = answer, calls, errors

    def _counts(self) -> dict[str, int]:
        """The episode's calls so far, and those that failed (the step's metrics)."""
        return {"tool_calls": self.calls, "tool_errors": self.errors}

    def _call_in(self, action: str) -> tuple[str, Any] | None:
        if self.call_format == "simple":
            found = _SIMPLE.match(action)
            return None if found is None else (found.group(1), found.group(2))
        found = HERMES_CALL.search(action)
        if found is None:
            return None
        try:
            call = json.loads(found.group(1))
            return str(call["name"]), call.get("arguments", {})
        except (ValueError, KeyError, TypeError):  # a call, but unreadable: an error result
            return "", 'the call is not JSON {"name": ..., "arguments": {...}}'

    def _run(self, name: str, arguments: Any) -> str:
        if not name:
            return f"error: {arguments}"
        fn = self.tools.get(name)
        if fn is None:
            return f"error: no tool {name!r}; the tools are {', '.join(self.tools)}"
        try:
            kwargs = self._arguments(fn, arguments)
            return str(fn(**kwargs))
        except Exception as error:  # the tool's failure is the model's observation
            return f"error: {type(error).__name__}: {str(error)[:200]}"

    @staticmethod
    def _arguments(fn: Callable[..., Any], arguments: Any) -> dict[str, Any]:
        params = list(inspect.signature(fn).parameters)
        if isinstance(arguments, str):
            if len(params) == 1 and not arguments.lstrip().startswith("{"):
                return {params[0]: arguments}
            arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            raise TypeError(f"{fn.__name__} takes its arguments as an object of {params}")
        return arguments

    def _score(self, action: str) -> float:
        if self.answer is None:
            return 0.0
        if self.last_number:
            numbers = _NUMBER.findall(action)
            return float(bool(numbers) and numbers[-1] == self.answer.strip())
        return float(action.strip() == self.answer.strip())


def tool_function(path: str) -> Callable[..., Any]:
    """The tool a "package.module:function" name names, imported; one without a schema (a
    parameter without a type hint) is refused here, not at its first call."""
    module_name, _, name = path.partition(":")
    fn = getattr(importlib.import_module(module_name), name, None) if name else None
    if not callable(fn):
        raise ValueError(f"tool {path!r} is not a function 'package.module:function'")
    schema_of(fn)
    return fn


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def calculator(expression: str) -> str:
    """Evaluate an integer arithmetic expression (+, -, *, //, %, parentheses).

    Args:
        expression: the expression, e.g. 123*45
    """
    if len(expression) > 200:
        raise ValueError("the expression is longer than 200 characters")
    return str(_evaluate(ast.parse(expression.strip(), mode="eval").body))


def _evaluate(node: ast.AST) -> int:
    """The value of an arithmetic tree of integers, nothing else (never eval)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Mult) and abs(left) * abs(right) > 10**30:
            raise ValueError("the product is too large")
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(f"not integer arithmetic: {ast.dump(node)[:60]}")
