"""Problems found in a flow, and the one error that reports all of them at once."""

from __future__ import annotations

import difflib
from collections.abc import Collection

import attrs

__all__ = ["FlowError", "Problem", "suggest"]


@attrs.frozen(kw_only=True)
class Problem:
    """One thing wrong with a flow: where (op, port), what was expected and found, how to fix it."""

    rule: str  # a short stable id: type-mismatch, unbound-input, cycle, duplicate-name, ...
    message: str
    op: str | None = None
    port: str | None = None
    expected: str | None = None
    found: str | None = None
    fix: str | None = None

    def __str__(self) -> str:
        where = []
        if self.op is not None:
            where.append(f"op {self.op!r}")
        if self.port is not None:
            where.append(f"port {self.port!r}")
        text = f"[{self.rule}] " + (", ".join(where) + ": " if where else "") + self.message
        if self.expected is not None or self.found is not None:
            text += f"\n     expected: {self.expected}\n     found:    {self.found}"
        if self.fix:
            text += f"\n     fix: {self.fix}"
        return text


def suggest(word: str, choices: Collection[str], known: str = "known") -> str:
    """A fix for a misspelt name: the close choice, if there is one, then all of them."""
    close = difflib.get_close_matches(word, choices, n=1)
    return (f"did you mean {close[0]!r}? " if close else "") + f"{known}: " + (
        ", ".join(choices) or "none")


class FlowError(Exception):
    """Raised once when a flow is built, listing every problem found."""

    def __init__(self, flow_name: str, problems: list[Problem]) -> None:
        self.flow_name = flow_name
        self.problems = tuple(problems)
        count = len(self.problems)
        lines = [f"flow {flow_name!r} has {count} error{'s' if count != 1 else ''}:"]
        lines += [f"  {i}. {problem}" for i, problem in enumerate(self.problems, 1)]
        super().__init__("\n".join(lines))
