"""Settings records of the op contract, each default written once.

`SamplingConfig` is how a `generate` call samples, `AgentConfig` whether its samples are
multi-turn trajectories in an environment. Generate's declaration (dataflows/model_ops.py)
takes its config keys, defaults, ranges and choices from it; the executors (executors/sim/ops.py,
executors/torch/rollout/generate.py) read a task's settings through it, so a key a task lacks gets
the record's default, never one of the executor's own; the RL flows hold one
(dataflows/rl/config.py). tests/test_defaults.py holds them all to the record.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from flowkit.ops.records import STALE_SEGMENTS
from flowkit.ops.rollout_engines import ENTROPY_ON_VLLM, ROLLOUT_ENGINES

__all__ = ["AGENT", "AGENT_KEYS", "AGENT_RANGES", "MODEL_EOS", "SAMPLING", "SAMPLING_CHOICES",
           "SAMPLING_KEYS", "SAMPLING_RANGES", "AgentConfig", "SamplingConfig"]

MODEL_EOS = "model"
"""eos="model": stop at the model's tokenizer's EOS, or byte 10 for a model without one
([Note: rollout text] in executors/torch/rollout/engine.py)."""


def _setting(default: Any, *, low: float | None = None, high: float | None = None,
             choices: tuple | None = None) -> Any:
    """A field with its default and what a flow check allows: a range (low, high; None: open)
    or choices. They are checked when a flow is built (flowkit/dsl/flow.py reports a Problem),
    not when a record is made, so a bad value names the op that got it."""
    metadata: dict[str, Any] = {}
    if low is not None or high is not None:
        metadata["range"] = (low, high)
    if choices is not None:
        metadata["choices"] = choices
    return attrs.field(default=default, metadata=metadata)


class _OpSettings:
    """A settings record of an op: its fields are config keys of the op's tasks."""

    def as_config(self) -> dict[str, Any]:
        """The settings as an op's config keys."""
        return attrs.asdict(self, recurse=False)  # type: ignore[arg-type]

    @classmethod
    def split(cls, config: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
        """A task's config as (its settings of this record, the other keys). A key it lacks
        has the record's default: a task the planner made has every one (the op's config is
        the record's), a direct call (a test, a bench) may leave some out."""
        keys = {field.name for field in attrs.fields(cls)}  # type: ignore[arg-type]
        given = {key: value for key, value in config.items() if key in keys}
        return cls(**given), {key: v for key, v in config.items() if key not in keys}


@attrs.frozen(kw_only=True)
class SamplingConfig(_OpSettings):
    """How generation samples: `n` samples per prompt of at most `max_new_tokens` tokens, at
    `temperature` (0: greedy) from the top-p set (`top_p` of the mass) within the `top_k` most
    likely tokens (0: all), each ending at `eos`
    (a token id, a list of them, None for none, or MODEL_EOS). `sample_seed` seeds the draws
    (None: the model's seed); a run's step k draws afresh from it. `take` (partial rollouts):
    a step takes the first `take` groups of an over-provisioned call and carries the rest
    over, recomputing or dropping those too stale as `stale_segments` says ([Note: partial
    rollouts] in flowkit/runner/partial.py); the runner reads it, executors never get it.
    `engine` is the rollout engine that samples (flowkit.ops.ROLLOUT_ENGINES: the executor's
    own, or vLLM's); a run's `rollout_engine` (--rollout-engine) sets it for every generate.
    Tree rollouts (LATR, BranchGRPO): a sample that reaches a response depth in `branch_at`
    forks into `branches` samples sharing its prefix, so a prompt has up to
    n * branches ** len(branch_at) samples ([Note: tree rollouts] in
    executors/torch/rollout/branching.py; on vLLM: [Note: vLLM trees]). With `branch_entropy`
    (nats), each depth of `branch_at` is where a level may begin, and a sample forks at its
    first token from there whose sampling distribution has at least that entropy: branches
    part where the model is unsure ([Note: entropy branching] in
    executors/torch/rollout/branching.py; flowkit's own engine only)."""

    n: int = _setting(1, low=1)
    max_new_tokens: int = _setting(256, low=1)
    temperature: float = _setting(1.0, low=0)
    top_p: float = _setting(1.0, low=0, high=1)
    top_k: int = _setting(0, low=0)
    eos: Any = _setting(MODEL_EOS)
    sample_seed: int | None = _setting(None)
    take: int | None = _setting(None, low=1)
    stale_segments: str = _setting("recompute", choices=STALE_SEGMENTS)
    engine: str = _setting("flowkit", choices=ROLLOUT_ENGINES)
    branch_at: tuple = _setting(())
    branches: int = _setting(1, low=1)
    branch_entropy: float | None = _setting(None, low=0)

    @property
    def branching(self) -> bool:
        """Whether it grows tree rollouts: some depth to branch at, into 2 or more."""
        return bool(self.branch_at) and self.branches > 1

    def branching_errors(self) -> list[str]:
        """What is wrong with its tree rollouts' settings, each a sentence; none: usable."""
        errors = []
        if int(self.branches) < 1:
            errors.append(f"branches must be at least 1 (samples a branch point forks into), "
                          f"got {self.branches}")
        depths = [int(d) for d in self.branch_at]
        if len(set(depths)) != len(depths):
            errors.append(f"branch_at must not repeat a depth, got {tuple(self.branch_at)}")
        errors += [f"branch_at depth {d} must lie in 1 .. max_new_tokens - 1 = "
                   f"{int(self.max_new_tokens) - 1} (a branch draws its token d itself)"
                   for d in depths if not 1 <= d < int(self.max_new_tokens)]
        if self.branch_entropy is not None and not self.branching:
            errors.append(f"branch_entropy={self.branch_entropy} picks where tree rollouts "
                          f"fork, and none grow: give branch_at (where each level may begin) "
                          f"and branches >= 2, or drop branch_entropy")
        if self.branching and self.branch_entropy is not None and self.engine != "flowkit":
            errors.append(ENTROPY_ON_VLLM)
        return errors


SAMPLING = SamplingConfig()
"""The defaults, for a value that must be a plain default (a function's keyword)."""

SAMPLING_KEYS = tuple(field.name for field in attrs.fields(SamplingConfig))
SAMPLING_RANGES = {field.name: field.metadata["range"] for field in attrs.fields(SamplingConfig)
                   if "range" in field.metadata}
SAMPLING_CHOICES = {field.name: field.metadata["choices"]
                    for field in attrs.fields(SamplingConfig) if "choices" in field.metadata}


@attrs.frozen(kw_only=True)
class AgentConfig(_OpSettings):
    """Multi-turn rollouts [Note: multi-turn rollouts in flowkit/ops/environments.py]: each
    sample steps an `environment` ("package.module:Class", an Environment built with
    `env_config` on the rollout executor; None: one response, no environment) for at most
    `max_turns` model turns of at most the sampling's max_new_tokens each and
    `max_total_tokens` response tokens in all (model and environment; None: no total bound);
    a step past `env_timeout_s` ends its trajectory. `keep_cache`: a sample waiting for its
    environment keeps its cache row (its next turn prefills the observation only) rather than
    giving the row to a waiting sample and prefilling its whole prefix again. `program`
    ("package.module:function", instead of an environment): each sample runs an agent
    written against the OpenAI chat-completions API, served by the rollout engine ([Note:
    agent programs] in executors/torch/rollout/endpoint.py)."""

    environment: str | None = _setting(None)
    program: str | None = _setting(None)
    env_config: dict = attrs.field(factory=dict)
    max_turns: int = _setting(1, low=1)
    max_total_tokens: int | None = _setting(None, low=1)
    env_timeout_s: float = _setting(30.0, low=0)
    keep_cache: bool = _setting(True)


AGENT = AgentConfig()
AGENT_KEYS = tuple(field.name for field in attrs.fields(AgentConfig))
AGENT_RANGES = {field.name: field.metadata["range"] for field in attrs.fields(AgentConfig)
                if "range" in field.metadata}
