"""The records that move between ops: what executors return and flows consume (prompts,
rollouts, per-token scores, experiences, microbatch and step stats, weights versions).

Per-token arrays are plain lists here so records stay msgpack-friendly and free of torch; ops that
need tensors build them at their boundary.
"""

from __future__ import annotations

from typing import Any

import attrs

from flowkit.dsl import Tensor

__all__ = [
    "BroadcastWeights",
    "Experience",
    "MicrobatchStats",
    "Prompt",
    "Rollout",
    "STALE_SEGMENTS",
    "Scored",
    "SharedWeights",
    "StepMetrics",
    "TokenIds",
    "TokenScores",
    "WeightsVersion",
    "mean_loss",
    "mean_values",
    "microbatch_stats",
    "resumable",
    "sample_indices",
    "samples_of",
    "step_report",
]

TokenIds = Tensor["int64", "batch", "seq"]
"""A batch of token sequences: what language-model pretraining and SFT consume. A sequence of
T + 1 ids is read as its first T and predicts its last T. An entry ~t (-1 - t) is token t,
read but not predicted: the loss skips the position whose target it is (an SFT prompt, the
padding), as ignore_index does for a separate labels tensor."""


@attrs.frozen(kw_only=True)
class Prompt:
    """One prompt to sample responses to: what a prompt source op yields."""

    prompt_id: int
    """Its number within the step; a group of samples of one prompt shares it (`group_by`)."""
    tokens: list[int]
    """The prompt's token ids, as the model reads them (after the chat template, if any)."""
    answer: str | None = None
    """What a verifiable reward checks the response against, when there is one."""
    text: str | None = None
    """The prompt as the model sees it (after the chat template), when a tokenizer made it."""
    messages: list[dict] | None = None
    """The chat messages the template rendered into `text`, when a prompt source kept them (an
    agent program starts its conversation from them: executors/torch/rollout/endpoint.py)."""
    n: int | None = None
    """How many samples of it to generate, when a flow chose so per prompt (adaptive sampling,
    dataflows/rl/adaptive.py); None: the generate op's `n`."""


@attrs.frozen(kw_only=True)
class Rollout:
    """One sampled response to one prompt, with the sampler's per-token log-probabilities."""

    prompt_id: int
    """The `Prompt.prompt_id` it answers."""
    sample: int
    """Its index among the n samples of its prompt."""
    prompt_tokens: list[int]
    """The prompt's token ids (`Prompt.tokens`)."""
    response_tokens: list[int]
    """The sampled token ids, the end-of-sequence token included when it was sampled."""
    logprobs: list[float]
    """The sampler's log-probability of each response token."""
    finished: bool = True
    """False when cut at max_new_tokens or by the model's context."""
    answer: str | None = None
    """The prompt's `answer`, carried along for the reward."""
    clipped: bool = False
    """True when the model's context cut it before max_new_tokens (then `finished` is False): a
    flow reports the fraction, since such responses are shorter than the flow asked for."""
    versions: list[int] = attrs.field(factory=list)
    """The weights version that sampled each response token (-1: the weights it was built
    with)."""
    interrupted: bool = False
    """True when generation was stopped before the sample ended (an abort): a later generate
    given this Rollout continues it from its prefix."""
    prompt_text: str | None = None
    """The prompt as text, decoded by the generating model's tokenizer; None for a model without
    one (the built-in GPT on bytes) [Note: rollout text in executors/torch/rollout/engine.py]."""
    response_text: str | None = None
    """The response as text, decoded as `prompt_text` is."""
    response_mask: list[int] = attrs.field(factory=list)
    """A multi-turn trajectory's response holds the model's turns and the environment's: 1 for
    a token the model sampled (trained), 0 for one the environment gave (context); empty: every
    response token is the model's [Note: multi-turn rollouts in flowkit/ops/environments.py]."""
    turns: int = 1
    """The model's turns."""
    env_reward: float | None = None
    """The sum of the environment's step rewards."""
    env_error: str | None = None
    """Why the environment ended the trajectory early."""
    env_info: dict[str, float] = attrs.field(factory=dict)
    """The numbers its environment's last step reported (EnvStep.info: a tool environment's
    tool_calls, ...) and env_seconds, its time in environment calls."""
    prompt_messages: list[dict] | None = None
    """A trajectory's prompt source messages (`Prompt.messages`), which an agent program starts
    from again if its trajectory restarts; None for single responses."""
    env_state: dict | None = None
    """An interrupted trajectory's episode, when its environment saves its state (plain data:
    Environment.state, and where the trajectory stood), for an executor without it to go on."""
    branch_of: int | None = None
    """A tree rollout's branch: the sample whose first `shared_tokens` response tokens it shares
    (and their cache) and from where it drew on alone; None: a sample of its own [Note: tree
    rollouts in executors/torch/rollout/branching.py]."""
    shared_tokens: int = 0
    """How many leading response tokens it shares with sample `branch_of` (0 without one): a
    step's generated tokens count them once."""

    @property
    def response_length(self) -> int:
        """What the runner learns of each sample without fetching it (a report key)."""
        return len(self.response_tokens)

    @property
    def sequence_length(self) -> int:
        """Its tokens, prompt and response: what a backprop with microbatch_tokens learns of
        each item without fetching it (a report key)."""
        return len(self.prompt_tokens) + len(self.response_tokens)

    @property
    def oldest_version(self) -> int | None:
        """The version of its first response token (versions never decrease along a
        sample), -1 counting as 0: the weights the run started from."""
        return max(0, self.versions[0]) if self.versions else None

    @property
    def version_span(self) -> list:
        """[prompt_id, sample, first version, last version, response length]: what a trace
        records of each generated sample (Generate.traced), so which weights sampled it can be
        read off the trace; versions never decrease, so the ends bound them all (None, None
        when no version was recorded)."""
        versions = self.versions
        first, last = (versions[0], versions[-1]) if versions else (None, None)
        return [self.prompt_id, self.sample, first, last, len(self.response_tokens)]


def samples_of(prompt: Any, n: int) -> int:
    """How many samples of `prompt` a generate request makes: its own `n` when a flow set one
    (adaptive sampling), else the request's `n`."""
    own = getattr(prompt, "n", None)
    return n if own is None else int(own)


def sample_indices(prompt: Any, n: int, first_sample: int = 0) -> range:
    """The indices of a generate request's fresh samples of `prompt`: `samples_of` them, from
    0; a later round of the prompt's samples (`first_sample` > 0, [Note: second rounds] in
    flowkit/runner/second_round.py) the request's own `n`, numbered on from `first_sample`, so
    they draw what the samples of those indices would have drawn in one request."""
    if first_sample:
        return range(first_sample, first_sample + n)
    return range(samples_of(prompt, n))


STALE_SEGMENTS = ("recompute", "drop")  # what a carried sample too stale to train becomes


def resumable(items: list, min_version: int | None, stale_segments: str = "recompute") -> list:
    """The items of a generate request, carried rollouts checked against the staleness bound
    [Note: partial rollouts in flowkit/runner/partial.py]: a Rollout whose oldest token is
    older than `min_version` is sampled again from its prompt ("recompute": an interrupted
    Rollout with no response yet), or its whole group is dropped ("drop": an empty request).
    Prompts, and Rollouts fresh enough, are as they were."""
    if min_version is None:
        return list(items)
    stale = [isinstance(item, Rollout) and item.oldest_version is not None
             and item.oldest_version < min_version for item in items]
    if not any(stale):
        return list(items)
    if stale_segments == "drop":
        return []
    if stale_segments != "recompute":
        raise ValueError(f"stale_segments={stale_segments!r}: it is 'recompute' or 'drop'")
    return [attrs.evolve(item, response_tokens=[], logprobs=[], versions=[], finished=False,
                         clipped=False, interrupted=True, response_text=None,
                         response_mask=[], env_state=None) if old else item
            for item, old in zip(items, stale)]


@attrs.frozen(kw_only=True)
class Scored(Rollout):
    """A rollout with its sequence-level reward: a reward op builds it from its Rollout,
    `Scored(**attrs.asdict(rollout, recurse=False), reward=...)`."""

    reward: float
    """The sequence-level reward the advantages are computed from."""
    task_reward: float | None = None
    """The reward before any shaping changed it (DAPO's overlong penalty), None when nothing
    did."""


@attrs.frozen(kw_only=True)
class TokenScores:
    """One float per response token of one sample (log-probabilities, values), keyed by sample."""

    prompt_id: int
    sample: int
    values: list[float]


@attrs.frozen(kw_only=True)
class Experience(Scored):
    """A scored rollout with per-token advantages and returns: ready to train on."""

    advantages: list[float]
    """One advantage per response token: GRPO's and RLOO's group-relative advantage of the
    sample on each token, PPO's GAE whitened over the batch. Before an estimator runs it holds
    token rewards (the KL penalty on each token, the reward on the last: kl_token_rewards)."""
    returns: list[float] = attrs.field(factory=list)
    """One return per response token, what a value model is trained toward (PPO's GAE advantage
    plus value); empty where no estimator sets them."""
    ref_logprobs: list[float] = attrs.field(factory=list)
    """The reference model's log-probability of each response token, for the KL term; empty
    without a reference."""
    values: list[float] = attrs.field(factory=list)
    """The value model's estimate at each response token (PPO); empty without a critic."""
    token_weights: list[float] = attrs.field(factory=list)
    """How much each response token weighs in the loss, in (0, 1]; empty: 1 each. A tree
    rollout's leaf weighs a token it shares with other leaves 1 / (the leaves sharing it), so
    that summed over them the prefix trains once [Note: tree rollouts' shared prefix in
    dataflows/rl/trees.py]."""


@attrs.frozen(kw_only=True)
class MicrobatchStats:
    """What a microbatch's backward leaves behind besides gradients: its loss (a mean per
    token) and token count; for a loss backpropagated as a sum over tokens (the RL losses), the
    count the optimizer step divides the step's gradients by (0: already a mean)."""

    loss: float
    tokens: int
    normalizer: float = 0.0
    # means over the microbatch's tokens a loss reports besides itself (the decoupled
    # objective's importance weights), averaged over the step by tokens (mean_values)
    values: dict[str, float] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class StepMetrics:
    """A flow step's optimizer steps: one, or one per minibatch round [Note: minibatch rounds
    in flowkit/ops/minibatches.py], whose losses this averages by tokens, gradient norms (before
    clipping) plainly, and tokens sums (a token trained on in two epochs counts twice)."""

    step: int
    loss: float
    grad_norm: float
    tokens: int
    optimizer_steps: int = 1


@attrs.frozen(kw_only=True)
class WeightsVersion:
    """Names the weights an optimizer step produced; generation asks for them by version."""

    model: str
    version: int


@attrs.frozen(kw_only=True)
class BroadcastWeights:
    """One stage's exported weights sent through a process group (NCCL across GPUs, gloo on
    CPUs) instead of the data plane [Note: weights by broadcast in
    executors/torch/weight_broadcast.py]: the group, the buffer's bytes and where each tensor
    lies in it. Its fields come over the wire: the executor that receives it checks them."""

    group: str
    serial: int  # the group's broadcasts, in the order they were sent
    size: int
    tensors: list  # [unsplit name, dtype, shape, byte offset] each


@attrs.frozen(kw_only=True)
class SharedWeights:
    """One stage's exported weights left on its GPU, for executors on the same GPU to copy
    without the host [Note: weights on one GPU in executors/torch/cuda_share.py]: the CUDA IPC
    handle of one device buffer and where each tensor lies in it. Its fields come over the
    wire: the executor that opens it checks every one first."""

    gpu: str  # the device's UUID
    pid: int  # the exporting process
    process: str  # ... a random name of it (pids repeat across PID namespaces)
    key: int  # the export, in that process
    handle: bytes  # the buffer's cudaIpcMemHandle
    size: int  # the buffer's bytes
    offset: int  # its place in the IPC block
    readers: dict  # executor name -> [ref counter file, slot, event handle, event to wait on]
    tensors: list  # [unsplit name, dtype, shape, byte offset] each


def microbatch_stats(inputs: tuple) -> list[MicrobatchStats]:
    """The MicrobatchStats among an op's inputs (they come in lists: gathered microbatches)."""
    return [s for value in inputs if isinstance(value, list) for s in value
            if isinstance(s, MicrobatchStats)]


def mean_loss(stats: list[MicrobatchStats]) -> tuple[float, int]:
    """A step's loss over its microbatches' stats and its tokens: a loss in sum form is the
    summed losses over the summed normalizers (the whole batch's, however it was cut), any
    other token-weighted (a plain mean where they count no tokens)."""
    tokens = sum(s.tokens for s in stats)
    normalizer = sum(s.normalizer for s in stats)
    if normalizer > 0:
        return sum(s.loss * s.normalizer for s in stats) / normalizer, tokens
    if tokens:
        return sum(s.loss * s.tokens for s in stats) / tokens, tokens
    return sum(s.loss for s in stats) / max(1, len(stats)), 0


def mean_values(stats: list[MicrobatchStats]) -> dict[str, float]:
    """The step's token-weighted mean of each value its microbatches' stats report; a value
    named .../max or ..._max is a largest, and the step's is the largest of them."""
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for s in stats:
        for key, value in s.values.items():
            if not s.tokens:
                continue
            if _is_max(key):
                totals[key] = max(totals.get(key, float("-inf")), float(value))
                counts[key] = 1
            else:
                totals[key] = totals.get(key, 0.0) + float(value) * s.tokens
                counts[key] = counts.get(key, 0) + s.tokens
    return {key: totals[key] / counts[key] for key in totals if counts[key]}


def _is_max(key: str) -> bool:
    return key.endswith(("/max", "_max"))


def step_report(inputs: tuple, *, model: str, step: int,
                grad_norm: float) -> tuple[StepMetrics, WeightsVersion]:
    """What an optimizer step reports from its inputs' microbatch stats: the loss per token
    (`mean_loss`), and the version of the weights it made; the last round of a flow step also
    reads the earlier rounds' reports and folds them in (`StepMetrics`). Every round of a flow
    step makes the same version: only the last one's weights leave the trainers."""
    loss, tokens = mean_loss(microbatch_stats(inputs))
    earlier = [m for value in inputs if isinstance(value, list) for m in value
               if isinstance(m, StepMetrics)]
    if earlier:
        summed = loss * tokens + sum(m.loss * m.tokens for m in earlier)
        tokens += sum(m.tokens for m in earlier)
        loss = summed / tokens if tokens else loss
        grad_norm = (grad_norm + sum(m.grad_norm for m in earlier)) / (len(earlier) + 1)
    metrics = StepMetrics(step=int(step), loss=loss, grad_norm=grad_norm, tokens=tokens,
                          optimizer_steps=1 + sum(m.optimizer_steps for m in earlier))
    return metrics, WeightsVersion(model=model, version=int(step) + 1)
