"""Tool calls as a model's turn writes them, read back: the Hermes format (Qwen2.5 and other
Hermes-style chat templates), ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
anywhere in the turn. dataflows/tools.py's ToolEnvironment and the agent programs' endpoint
(executors/torch/rollout/endpoint.py) read calls the same way.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["HERMES_CALL", "hermes_calls"]

HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def hermes_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """The turn's text without its readable calls (stripped), and those calls, each
    ``{"name": str, "arguments": dict}``. A block that is not such a call stays in the text,
    as the model wrote it."""
    calls: list[dict[str, Any]] = []

    def take(found: re.Match) -> str:
        try:
            call = json.loads(found.group(1))
            name, arguments = call["name"], call.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            return found.group(0)
        if not isinstance(name, str) or not isinstance(arguments, dict):
            return found.group(0)
        calls.append({"name": name, "arguments": arguments})
        return ""

    rest = HERMES_CALL.sub(take, text)
    return (rest.strip() if calls else text), calls
