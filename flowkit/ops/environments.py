"""Environments for multi-turn rollouts: the interface a flow's environment implements, and what
each of its steps returns. Plain Python, text in and text out (the gymnasium shape).

[Note: multi-turn rollouts] A `generate` call given `environment="package.module:Class"` (and
`env_config`, `max_turns`, `max_total_tokens`, `env_timeout_s`: flowkit.ops.AgentConfig) rolls
out trajectories rather than single responses. Each sample gets its own environment,
``Class(**env_config)``, built on the rollout executor, and:

1. ``reset(prompt, answer)`` with the prompt's text and its answer (what a verifiable reward
   checks against, or None); what it returns, unless None or "", is appended to the response
   as context before the model's first turn (the built-in GPT's; a chat template's prompt
   carries it instead). With a chat template it may return a `Conversation` instead: the
   messages (and tools) that open the trajectory, rendered by the template in place of the
   prompt source's rendering (an agent program's first request does so: [Note: agent
   programs] in executors/torch/rollout/endpoint.py);
2. the model samples a turn, which ends at the stop token (EOS) or after `max_new_tokens`;
3. ``step(action)`` gets the turn's text; its `EnvStep` says the observation, the reward, and
   whether the trajectory is done. The observation's tokens are appended as the model's chat
   format renders an environment turn (executors/torch/rollout/turns.py), never re-tokenizing what
   came before: a text is a user message; with a chat template the observation may also be a list
   of messages (a "tool" role's results, several at once), rendered as the template renders
   them after an assistant turn;
4. until done, `max_turns` model turns, or `max_total_tokens` response tokens; then
   ``close()``.

The Rollout keeps every token: `response_mask` marks the model's (1: trained) and the
environment's (0: context, neither trained nor counted in a token mean), `turns` counts the model
turns, and `env_reward` sums the steps' rewards (a flow scores it with
dataflows.rewards.environment_reward, or with any reward op of its own). A trajectory the
environment ended is `finished`; one cut by a budget is not (with `mask_truncated` it trains
nothing). A step that raises, or runs past `env_timeout_s`, ends its trajectory, unfinished, with
`env_error` saying why; it never stalls the engine, which steps the other samples meanwhile. An
environment that runs untrusted code (a tool executing a model's program) runs it in the sandbox
(dataflows/sandbox.py), since a thread past its timeout cannot be stopped, only abandoned. A
trajectory cut by an abort (partial rollouts) keeps its episode on the executor and goes on
when a later request continues it ([Note: parked trajectories] in
executors/torch/rollout/trajectories.py).
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
