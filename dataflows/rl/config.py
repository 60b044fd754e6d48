"""The RL flows' settings, as records, each default written once.

`RLConfig` holds what every ready-made RL flow (grpo, ppo, rloo, reinforce_pp) reads, its
generation settings as a `SamplingConfig` (flowkit/ops/configs.py, Generate's own record);
`GroupRLConfig`, `PPOConfig` and `ReinforcePPConfig` add or change what their algorithms need.
A default that is another op's setting is read from that op's declaration (the microbatches of
Backprop, the lr of OptimizerStep, ...), so the two cannot drift apart.

A flow function takes `config` (its record; a plain RLConfig gets the record's other fields at
their defaults) and keyword shortcuts, one per setting (`rl_flow`): `grpo_flow(prompts=16, n=8,
max_new_tokens=8)` is `grpo_flow(GroupRLConfig(prompts=16, sampling=SamplingConfig(n=8,
max_new_tokens=8)))`. A shortcut defaults to None, the record's value, so None cannot override
a record's value (give such a record instead).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from dataflows.model_ops import Backprop, OptimizerStep
from dataflows.rl.adaptive import AdaptiveSampling
from dataflows.rl.advantages import reinforce_pp_advantages
from dataflows.rl.ops import answer_reward, arithmetic_prompts
from flowkit.dsl import Flow, Operator
from flowkit.ops import (
    AGENT_KEYS,
    LOSS_KNOBS,
    ROUND_KNOBS,
    SAMPLING_KEYS,
    AgentConfig,
    SamplingConfig,
)

__all__ = ["POLICY_KEYS", "GroupRLConfig", "PPOConfig", "PolicyLoss", "RLConfig",
           "ReinforcePPConfig", "actor_loss", "rl_flow", "shortcuts_of", "with_shortcuts"]


@attrs.frozen(kw_only=True)
class PolicyLoss:
    """How the actor's loss is taken, by verl's names (flowkit/ops/losses.py's LOSS_KNOBS says
    each, with its default): the clip range and clip-higher, the aggregation mode, GSPO, an
    entropy bonus, masking cut responses, and the rollout correction (TIS / MIS)."""

    clip_ratio: float = LOSS_KNOBS["clip_ratio"]
    clip_ratio_low: float | None = LOSS_KNOBS["clip_ratio_low"]
    clip_ratio_high: float | None = LOSS_KNOBS["clip_ratio_high"]
    clip_ratio_c: float = LOSS_KNOBS["clip_ratio_c"]
    loss_agg_mode: str | None = LOSS_KNOBS["loss_agg_mode"]
    # None with seq-mean-token-sum-norm: the flow's max_new_tokens (actor_loss)
    loss_scale_factor: float | None = LOSS_KNOBS["loss_scale_factor"]
    policy_loss: str = LOSS_KNOBS["policy_loss"]
    entropy_coeff: float = LOSS_KNOBS["entropy_coeff"]
    mask_truncated: bool = LOSS_KNOBS["mask_truncated"]
    rollout_is: str | None = LOSS_KNOBS["rollout_is"]
    rollout_is_mode: str = LOSS_KNOBS["rollout_is_mode"]
    rollout_is_threshold: float = LOSS_KNOBS["rollout_is_threshold"]
    rollout_is_threshold_lower: float | None = LOSS_KNOBS["rollout_is_threshold_lower"]
    rollout_is_veto_threshold: float | None = LOSS_KNOBS["rollout_is_veto_threshold"]


POLICY_KEYS = tuple(field.name for field in attrs.fields(PolicyLoss))


def _tags(value: str | tuple | list) -> tuple[str, ...]:
    """Tags as given, a single one as a string too ("rollout")."""
    return (value,) if isinstance(value, str) else tuple(value)


@attrs.frozen(kw_only=True)
class RLConfig:
    """`prompts` a step, from `prompt_source` (`count=prompts`, plus `source_config`), each
    sampled as `sampling` says and scored by `reward` (one rollout). The actor trains in
    `stages` (None: its own; the built-in GPT's 2) under `schedule` with `microbatches`, at
    `lr`, `kl_coef` weighing the KL to the reference (in the loss or the reward: the flow's).
    `max_staleness`: run asynchronously, generation up to that many weights versions ahead of
    training ([Note: asynchronous steps] in flowkit/runner/flowrun.py; None: synchronous).
    `oversample` > 1: partial rollouts, that many times the prompts generate and the step
    takes the first `prompts` groups to finish (the flow sets `sampling.take`). `eval_source`:
    held-out prompts (`eval_prompts` of them, `eval_source_config` its settings, e.g. another
    seed) that `flowkit run --eval-every K` samples `eval_n` times each at `eval_temperature`
    (0: greedy) with the newest weights, a sample right when its reward is at least
    `eval_pass_reward` (dataflows/rl/evaluation.py). `policy`: how the actor's loss is taken
    (clip-higher, aggregation, GSPO, rollout correction, ...; each a shortcut by its own name).
    `overlong_buffer` > 0: DAPO's soft overlong penalty, a response longer than
    max_new_tokens - overlong_buffer loses up to `overlong_penalty_factor` of its reward,
    linearly over the buffer (overlong_penalty). `reference_tags`: the executors the
    reference's log-probs run on (empty: the actor's tags), e.g. ("rollout",) beside the
    engines, whose idle time `flowkit run --fill-bubbles` adds the trainers' pipeline bubbles
    to ([Note: bubble filling] in flowkit/runner/bubble_fill.py). `agent`: each sample a multi-turn
    trajectory in an environment (flowkit.ops.AgentConfig, each setting a shortcut by its own
    name: `environment=`, `max_turns=`, ...; [Note: multi-turn rollouts in
    flowkit/ops/environments.py])."""

    prompts: int = 16
    stages: int | None = None
    # zero-bubble: the RL flows' backprops have many microbatches a step, and ZB-H1 fills the
    # bubble that 1F1B (Backprop's own default) leaves
    schedule: str = "zb-h1"
    microbatches: int = Backprop.config["microbatches"]
    lr: float = OptimizerStep.config["lr"]
    kl_coef: float = 0.001
    reference_tags: tuple[str, ...] = attrs.field(default=(), converter=_tags)
    max_staleness: int | None = None
    oversample: float = 1.0
    prompt_source: Operator = arithmetic_prompts
    reward: Operator = answer_reward
    source_config: Mapping[str, Any] | None = None
    sampling: SamplingConfig = SamplingConfig()
    agent: AgentConfig = AgentConfig()
    policy: PolicyLoss = PolicyLoss()
    overlong_buffer: int = 0
    overlong_penalty_factor: float = 1.0
    eval_source: Operator | None = None
    eval_prompts: int = 64
    eval_source_config: Mapping[str, Any] | None = None
    eval_n: int = 1
    eval_temperature: float = 0.0
    eval_pass_reward: float = 1.0

    @property
    def generated_prompts(self) -> int:
        """How many prompts a step generates: `oversample` times its own (partial rollouts)."""
        return math.ceil(self.prompts * self.oversample) if self.oversample > 1 else self.prompts

    @property
    def source_prompts(self) -> int:
        """How many prompts a step's source makes: those it generates, in every round."""
        return self.generated_prompts


@attrs.frozen(kw_only=True)
class GroupRLConfig(RLConfig):
    """GRPO's and RLOO's: a prompt's samples are a group, each sample's baseline the others',
    so a prompt is sampled 8 times. `scale_rewards=False`: GRPO's advantages without the
    division by the group's std (Dr. GRPO). `filter_groups` (GRPO): DAPO's dynamic sampling,
    `filter_oversample` times the prompts generate, the groups whose rewards are all equal are
    dropped, and the step trains the first `prompts` of the others to be scored [Note: group
    quota in flowkit/runner/quota.py]; where too few differ, another round of as many prompts
    generates, up to `filter_rounds` rounds in all (verl's max_num_gen_batches) [Note: sampling
    rounds in flowkit/runner/sampling_rounds.py], and a step still short trains fewer and says so in
    `grpo_advantages/groups_short`. `adaptive` (an AdaptiveSampling): each prompt's n from the
    pass rate of its earlier samples, within a step budget, groups of varying size [Note:
    adaptive sampling in dataflows/rl/adaptive.py]. `shared_prefix` (tree rollouts): "per_leaf",
    a token its leaves share trains once in each leaf, or "once", once in all [Note: tree
    rollouts' shared prefix in dataflows/rl/trees.py]. `reference_in_forward` (GRPO, whose KL
    term is in the loss): the actor's last stage takes the reference's log-probs in its own
    forward, one batched forward a microbatch, instead of scoring each rollout as it finishes
    [Note: reference in the F in executors/torch/train/rows.py]."""

    sampling: SamplingConfig = SamplingConfig(n=8)
    scale_rewards: bool = True
    filter_groups: bool = False
    filter_oversample: float = 2.0
    filter_rounds: int = 1
    adaptive: AdaptiveSampling | None = None
    shared_prefix: str = "per_leaf"
    reference_in_forward: bool = False

    @property
    def generated_prompts(self) -> int:
        """With `filter_groups`, `filter_oversample` times the prompts generate (a round)."""
        if self.filter_groups:
            return math.ceil(self.prompts * self.filter_oversample)
        return super().generated_prompts

    @property
    def source_prompts(self) -> int:
        """With `filter_groups`, a round's prompts for each of `filter_rounds` rounds."""
        rounds = self.filter_rounds if self.filter_groups else 1
        return self.generated_prompts * rounds


@attrs.frozen(kw_only=True)
class PPOConfig(RLConfig):
    """PPO's: one sample a prompt (the critic is the baseline), more prompts, a stronger KL
    penalty in the token rewards; the critic trains at `critic_lr`. `ppo_epochs` and
    `minibatches`: actor and critic train on each step's batch `ppo_epochs` times, shuffled
    and cut into `minibatches`, one optimizer step each (Backprop's epochs and minibatches);
    `microbatches` is then per minibatch."""

    prompts: int = 64
    kl_coef: float = 0.05
    critic_lr: float = 1e-3
    ppo_epochs: int = ROUND_KNOBS["epochs"]
    minibatches: int = ROUND_KNOBS["minibatches"]
    # train actor and critic as one fused pipeline schedule on the same executors, the
    # critic's stages the other way round [Note: fused training in flowkit/runner/fusedtrain.py]
    fuse_models: bool = False


@attrs.frozen(kw_only=True)
class ReinforcePPConfig(RLConfig):
    """REINFORCE++'s: one sample a prompt, more prompts (the batch whitening is the baseline);
    `gamma` discounts the returns; `baseline` makes it REINFORCE++-baseline (n >= 2)."""

    prompts: int = 64
    gamma: float = reinforce_pp_advantages.config["gamma"]
    baseline: bool = False


# eos=None means "no stop token" and take is the flow's (from oversample): neither can be a
# shortcut whose None means "the record's"
_NOT_SHORTCUTS = ("sampling", "agent", "policy", "eos", "take")


def shortcuts_of(record: type[RLConfig]) -> tuple[str, ...]:
    """The keyword shortcuts of a flow configured by `record`: its settings, the sampling
    settings and the policy loss's, by name."""
    names = [field.name for field in attrs.fields(record)] + list(SAMPLING_KEYS) \
        + list(AGENT_KEYS) + list(POLICY_KEYS)
    return tuple(name for name in names if name not in _NOT_SHORTCUTS)


def with_shortcuts(config: RLConfig, **shortcuts: Any) -> RLConfig:
    """`config` with each shortcut given (not None): a sampling setting's name sets
    `config.sampling`'s, an agent setting's `config.agent`'s, a policy loss setting's
    `config.policy`'s, any other the record's field."""
    given = {name: value for name, value in shortcuts.items() if value is not None}
    sampling = {name: given.pop(name) for name in list(given) if name in SAMPLING_KEYS}
    agent = {name: given.pop(name) for name in list(given) if name in AGENT_KEYS}
    policy = {name: given.pop(name) for name in list(given) if name in POLICY_KEYS}
    return attrs.evolve(config, **given, sampling=attrs.evolve(config.sampling, **sampling),
                        agent=attrs.evolve(config.agent, **agent),
                        policy=attrs.evolve(config.policy, **policy))


def actor_loss(config: RLConfig) -> dict[str, Any]:
    """The actor Backprop's policy loss knobs: `config.policy`'s, Dr. GRPO's constant the
    generation budget unless given."""
    knobs = attrs.asdict(config.policy)
    if knobs["loss_agg_mode"] == "seq-mean-token-sum-norm" and knobs["loss_scale_factor"] is None:
        knobs["loss_scale_factor"] = config.sampling.max_new_tokens
    return knobs


def _as_record(config: RLConfig | None, record: type[RLConfig]) -> RLConfig:
    """`config` as a `record`: an RLConfig of another kind keeps the settings both have."""
    if config is None:
        return record()
    if not isinstance(config, RLConfig):
        raise TypeError(f"config must be a {record.__name__} (dataflows/rl/config.py), got "
                        f"{type(config).__name__}")
    if isinstance(config, record):
        return config
    known = {field.name for field in attrs.fields(record)}
    return record(**{k: v for k, v in attrs.asdict(config, recurse=False).items() if k in known})


def rl_flow(record: type[RLConfig]) -> Callable[[Callable[..., Flow]], Callable[..., Flow]]:
    """A flow function from `build(config, **arguments)`: it takes `config` (a `record`),
    build's own keywords (the models) and a keyword shortcut for each setting, None by default
    (the record's value). Its signature says all of them, for help() and the tests."""
    shortcuts = shortcuts_of(record)

    def decorate(build: Callable[..., Flow]) -> Callable[..., Flow]:
        @functools.wraps(build)
        def flow(config: RLConfig | None = None, **keywords: Any) -> Flow:
            given = {name: keywords.pop(name) for name in list(keywords) if name in shortcuts}
            return build(with_shortcuts(_as_record(config, record), **given), **keywords)

        flow.__signature__ = _signature(build, record, shortcuts)  # type: ignore[attr-defined]
        return flow

    return decorate


def _signature(build: Callable[..., Flow], record: type[RLConfig],
               shortcuts: tuple[str, ...]) -> inspect.Signature:
    own = list(inspect.signature(build).parameters.values())[1:]  # after config
    config = inspect.Parameter("config", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                               annotation=f"{record.__name__} | None")
    keyword = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
               for name in shortcuts]
    return inspect.Signature([config, *own, *keyword], return_annotation=Flow)
