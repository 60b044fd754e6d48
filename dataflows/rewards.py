"""Rewards on text: plain Python on (prompt, response, answer) strings, each a reward op Rollout
-> Scored. `text_reward` turns such a function into one; the ready ones check an answer exactly
(`exact_match_reward`), as mathematics (`math_reward`), or the response's format
(`format_reward`).

The texts are the rollout's [Note: rollout text in executors/torch/rollout/engine.py]: decoded by
the model's tokenizer. A rollout without them (a model without a tokenizer: the built-in GPT, whose
tokens are bytes) is read as bytes, as dataflows/rl/ops.answer_reward reads it.
"""

from __future__ import annotations

import inspect
import re
import threading
from collections.abc import Callable
from typing import Any

import attrs

from dataflows.sandbox import Limits, run_python
from flowkit.dsl import op
from flowkit.ops.records import Rollout, Scored

__all__ = ["code_reward", "environment_reward", "exact_match_reward", "format_reward",
           "last_number", "math_reward", "prompt_text", "response_code", "response_text",
           "text_reward"]

TextFn = Callable[..., float]


def response_text(rollout: Rollout) -> str:
    """The response as text [Note: rollout text]; its tokens as bytes when it has none."""
    if rollout.response_text is not None:
        return rollout.response_text
    return _bytes_text(rollout.response_tokens)


def prompt_text(rollout: Rollout) -> str:
    """The prompt as the model saw it; its tokens as bytes when it has no text."""
    if rollout.prompt_text is not None:
        return rollout.prompt_text
    return _bytes_text(rollout.prompt_tokens)


def _bytes_text(tokens: list[int]) -> str:
    return bytes(t for t in tokens if 0 <= t < 256).decode(errors="replace")


def text_reward(fn: TextFn | None = None, *, name: str | None = None,
                check: Callable[[dict[str, Any]], None] | None = None) -> Any:
    """A reward op from ``fn(prompt, response, answer, **config) -> float``: each rollout's
    texts in, a Scored with that reward out; fn's keyword-only parameters become the op's
    config. Executors import the op by its module and name, so it must be bound at module
    level under that name: decorate a module-level def (``@text_reward``), or give the name
    it is assigned to::

        @text_reward
        def says_yes(prompt, response, answer) -> float:
            return float("yes" in response.lower())

        shout = text_reward(lambda prompt, response, answer: float(response.isupper()),
                            name="shout")

    `check` validates a call's config when the flow is validated (see flowkit.dsl.op)."""

    def wrap(f: TextFn) -> Any:
        if name is None and ("<" in f.__qualname__):  # a lambda, or a def inside a function
            raise ValueError(f"text_reward({f.__qualname__}): executors import a reward op by "
                             "its module and name, so give the name it is bound to at module "
                             "level: my_reward = text_reward(fn, name='my_reward')")
        return op(_reward_fn(f, name or f.__qualname__), check=check)

    return wrap(fn) if fn is not None else wrap


def _reward_fn(f: TextFn, name: str) -> Callable[..., Scored]:
    """The op's function: a Rollout in, a Scored out, with `f`'s keyword-only config."""

    def reward(rollout: Rollout, **config: Any) -> Scored:
        value = f(prompt_text(rollout), response_text(rollout), rollout.answer, **config)
        return Scored(**attrs.asdict(rollout, recurse=False), reward=float(value))

    knobs = [p for p in inspect.signature(f).parameters.values() if p.kind is p.KEYWORD_ONLY]
    first = inspect.Parameter("rollout", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                              annotation=Rollout)
    reward.__signature__ = inspect.Signature([first, *knobs], return_annotation=Scored)
    reward.__annotations__ = {"rollout": Rollout, "return": Scored}
    reward.__module__, reward.__name__, reward.__qualname__ = f.__module__, name, name
    reward.__doc__ = f.__doc__
    return reward


def _needs(answer: str | None, what: str) -> str:
    if answer is None:
        raise ValueError(f"{what} checks answers, and this rollout has none: give the prompt "
                         "source an answer field (dataset_prompts' answer_field)")
    return answer


@text_reward
def exact_match_reward(prompt: str, response: str, answer: str | None) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the answer (also
    stripped), else 0.0."""
    return float(response.strip() == _needs(answer, "exact_match_reward").strip())


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_number(text: str) -> float | None:
    """The last number written in `text` (thousands separators allowed), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


@text_reward
def math_reward(prompt: str, response: str, answer: str | None, *,
                tolerance: float = 1e-6) -> float:
    """1.0 when the response's answer equals the answer as mathematics, else 0.0. With
    `math-verify` installed (the hf extra brings it), its parse and verify decide (LaTeX,
    \\boxed{...}, fractions, sets...); without it, the last number in the response is compared
    with the answer's, within `tolerance`. math-verify's timeout uses signals, which only the
    main thread may set: an op run on another thread verifies without one."""
    answer = _needs(answer, "math_reward")
    try:
        from math_verify import parse, verify
    except ImportError:
        got, want = last_number(response), last_number(answer)
        return float(got is not None and want is not None and abs(got - want) <= tolerance)
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(answer, parsing_timeout=timeout)
    found = parse(response, parsing_timeout=timeout)
    return float(bool(gold) and bool(found) and verify(gold, found, timeout_seconds=timeout))


_FENCED = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)```", re.S)


def response_code(response: str) -> str:
    """The code of a response: its last fenced block (```python ... ```), else all of it."""
    blocks = _FENCED.findall(response)
    return blocks[-1] if blocks else response


@text_reward
def code_reward(prompt: str, response: str, answer: str | None, *, timeout_s: float = 5.0,
                memory_mib: int = 1024) -> float:
    """1.0 when the response's code (`response_code`) followed by the answer's tests (Python,
    asserts) runs to a clean exit in the sandbox [Note: sandbox in dataflows/sandbox.py]
    within `timeout_s`, else 0.0: a failed assert, an error, a crash, a timeout, code that
    forks without end or reaches for the network all score 0 and never stall the step."""
    tests = _needs(answer, "code_reward")
    outcome = run_python(f"{response_code(response)}\n\n{tests}\n",
                         limits=Limits(timeout_s=timeout_s, memory_mib=memory_mib))
    return float(outcome.ok)


def _check_pattern(config: dict[str, Any]) -> None:
    try:
        re.compile(config["pattern"])
    except (re.error, TypeError) as exc:
        raise ValueError(f"format_reward's pattern {config['pattern']!r} is not a regular "
                         f"expression: {exc}") from None


@text_reward(check=_check_pattern)
def format_reward(prompt: str, response: str, answer: str | None, *,
                  pattern: str = r"\\boxed\{[^{}]+\}") -> float:
    """1.0 when `pattern` (a regular expression, searched anywhere: anchor it with ^...$ for
    the whole response) is found in the response, else 0.0. The default asks for an answer in
    \\boxed{...}."""
    return float(re.search(pattern, response, flags=re.DOTALL) is not None)


@op
def environment_reward(rollout: Rollout) -> Scored:
    """A trajectory's reward: the sum of its environment's step rewards [Note: multi-turn
    rollouts in flowkit/ops/environments.py]."""
    if rollout.env_reward is None:
        raise ValueError("environment_reward scores trajectories, and this rollout has no "
                         "environment: give the flow an environment (environment='module:Class') "
                         "or score its rollouts with another reward op")
    return Scored(**attrs.asdict(rollout, recurse=False), reward=float(rollout.env_reward))
