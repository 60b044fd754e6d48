"""Environments for multi-turn rollouts: the interface a flow's environment implements, and what
each of its steps returns. Plain Python, text in and text out (the gymnasium shape).

[Note: multi-turn rollouts] A `generate` call given `environment="package.module:Class"`
(flowkit.ops.AgentConfig) rolls out trajectories: each sample gets its own environment on the
rollout executor, `reset`, then model turns and `step`s until done or a budget, then `close`.
Token in, token out: an observation's tokens are appended as the model's chat format renders an
environment turn (executors/torch/rollout/turns.py), never re-tokenizing what came before, and the
Rollout's `response_mask` marks the model's tokens (1: trained) and the environment's (0:
context, neither trained nor counted in a token mean). A step that raises, or runs past
`env_timeout_s`, ends its own trajectory with `env_error`; it never stalls the engine, which
steps the other samples meanwhile (untrusted code runs in dataflows/sandbox.py: a thread past
its timeout cannot be stopped). A trajectory cut by an abort is parked on the executor
([Note: parked trajectories] in executors/torch/rollout/trajectories.py). In full: docs/rl.md,
"Agents: multi-turn rollouts in an environment".
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["Conversation", "EnvStep", "Environment"]

Message = dict[str, Any]  # a chat message: role, content, and tool_calls or tool_call_id


@attrs.frozen(kw_only=True)
class Conversation:
    """What `reset` may return with a chat template: the conversation that opens the
    trajectory (its messages, and the tools' schemas the template shows the model), rendered
    with the generation prompt as the trajectory's prompt."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None = None


@attrs.frozen(kw_only=True)
class EnvStep:
    """What one environment step returns."""

    # appended as the environment's turn ("" with done: nothing): a text is a user message; a
    # list of messages is rendered as the chat template renders them (a model with one)
    observation: str | list[Message] = ""
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = attrs.field(factory=dict)


class Environment:
    """Subclass and override `step` (and `reset` where the episode needs the prompt). One
    instance serves one trajectory; its constructor takes the flow's `env_config`."""

    def reset(self, prompt: str, answer: str | None = None) -> str | Conversation | None:
        """Start an episode on `prompt` (its text as the model sees it) whose ground truth is
        `answer` (the prompt's, None without one); an observation to show the model before its
        first turn, a Conversation to open it with instead of the prompt, or None."""
        return None

    def step(self, action: str) -> EnvStep:
        """The model's turn (its text, the stop token left out); the environment's answer."""
        raise NotImplementedError(f"{type(self).__name__} must define step(action) -> EnvStep")

    def state(self) -> Any:
        """The episode's state as plain data (dicts with string keys, lists, strings, numbers,
        booleans, None), or None (the default) when it cannot be saved. A trajectory cut by an
        abort between its environment's steps carries it in its Rollout, so that another
        executor, or a run resumed from a checkpoint, goes on with `restore` where it stopped
        ([Note: parked trajectories] in executors/torch/rollout/trajectories.py) rather than drawing
        the trajectory again from its prompt."""
        return None

    def restore(self, state: Any) -> None:
        """Take up the episode `state()` returned, in place of reset."""
        raise NotImplementedError(f"{type(self).__name__} saves no state")

    def close(self) -> None:
        """Called once its trajectory ends (finished, cut, aborted or failed), on the engine's
        thread: release what the episode holds (a process, a sandbox folder); keep it quick."""
