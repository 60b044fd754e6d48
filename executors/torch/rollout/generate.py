"""The torch executor's `generate` op, a request to its model's rollout engine [Note: rollout
engine in executors/torch/rollout/engine.py], and the `generation` op that pauses, resumes or aborts
it.

The design: [Note: generate], [Note: sampler log-probabilities], [Note: one generator per sample]
below.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from executors.optable import OpContext, OpTable
from executors.torch.errors import StageError
from executors.torch.models.built import held_model, right_padded, whole_model
from executors.torch.rollout import lm
from executors.torch.rollout.engine import Engine, Sampling, run_until_done
from executors.torch.rollout.turns import agent_of
from executors.torch.rollout.vllm_engine import vllm_engine_of
from flowkit.dsl.hf import has_tokenizer
from flowkit.ops.configs import AGENT_KEYS, MODEL_EOS, SAMPLING_KEYS, AgentConfig, SamplingConfig
from flowkit.ops.executor_ops import MODEL_KEYS
from flowkit.ops.records import Prompt, Rollout, resumable, samples_of
from flowkit.ops.tokenizers import eos_token_ids, load_tokenizer

__all__ = ["EOS", "MODEL_EOS", "decode", "generate_now", "register", "sample_token",
           "tokenizer_folder"]


# [Note: generate] `decode` below is the path before the engine: one call decodes its prompts'
# samples together (continuous batching within the call, a torch.Generator per sample), calls one
# after another. It stays as the baseline `flowkit bench rollout` measures the engine against.
#
# [Note: sampler log-probabilities] A rollout's ``logprobs[k]`` is ``log_softmax(logits /
# temperature)[token_k]`` over the whole vocabulary: the log-probability under the
# temperature-scaled distribution, before top-p truncation (as verl's rollouts record it). That is
# what the `logprobs` op (executors/torch/rollout/infer.py) recomputes from the model with the
# same `temperature` (exactly for a float64 model, a lower one's in float32: [Note: chunked
# log-probabilities] in sampling.py), so a PPO/GRPO ratio starts at 1. Greedy decoding
# (``temperature=0``) records ``log_softmax(logits)``, i.e. temperature 1.
#
# [Note: one generator per sample] In `decode`, each (prompt, sample) draws from its own
# torch.Generator, seeded from (seed, prompt_id, sample): what a sample draws does not depend on
# which slot it got or on what else was in the batch. (The engine goes further: a draw depends only
# on the sample's seed and the token's position, executors/torch/rollout/sampling.py.)

_STEP_SEEDS = 1_000_003  # step k samples with seed + k * this: fresh draws, same for a replay
EOS = 10  # byte "\n": the example corpora are byte-tokenized one-line answers; eos=None: none


# -- sampling ---------------------------------------------------------------------------------
def sample_token(logits: torch.Tensor, *, temperature: float, top_p: float,
                 generator: torch.Generator | None) -> tuple[int, float]:
    """One token from ``logits`` (V,) and its log-probability [Note: sampler log-probabilities],
    in float64 as the `logprobs` op computes a float64 model's."""
    logits = logits.to(torch.float64)
    if temperature <= 0:  # greedy
        token = int(torch.argmax(logits))
        return token, float(F.log_softmax(logits, dim=-1)[token])
    logp = F.log_softmax(logits / temperature, dim=-1)
    probs = _top_p(logp.exp(), top_p)
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(logp[token])


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always the top
    one); multinomial renormalizes."""
    if top_p >= 1.0:
        return probs
    sorted_p, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of the tokens ranked above
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
    sorted_p[0] = sorted_p[0].clamp_min(torch.finfo(sorted_p.dtype).tiny)
    return torch.zeros_like(probs).scatter(0, order, sorted_p)


def _generator(seed: int, prompt_id: int, sample: int, device: torch.device) -> torch.Generator:
    """[Note: one generator per sample]; tuple hashes of ints are stable across processes."""
    g = torch.Generator(device=device)
    g.manual_seed(hash((int(seed), int(prompt_id), int(sample))) & 0xFFFF_FFFF_FFFF)
    return g


# -- continuous batching ----------------------------------------------------------------------
@attrs.define(eq=False)
class _Seq:
    """One (prompt, sample) being decoded in a slot."""

    prompt: Any
    sample: int
    generator: torch.Generator
    tokens: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)

    @property
    def length(self) -> int:  # positions written or to write: prompt + response so far
        return len(self.prompt.tokens) + len(self.tokens)


@attrs.frozen(kw_only=True)
class _Sampling:
    n: int
    max_new_tokens: int
    temperature: float
    top_p: float
    eos: int | None
    seed: int
    max_batch: int


def decode(model: torch.nn.Module, prompts: list, s: _Sampling, device: torch.device,
           emit: Callable[[Any], None] | None = None) -> list:
    """Every (prompt, sample) decoded through `s.max_batch` slots; Rollouts in finishing order,
    each also given to `emit` the moment it is done (a streaming task's [Note: streaming ops]
    in executors/optable.py). A sample ends at EOS, at max_new_tokens, or when it fills the model's
    context (clipped)."""
    queue = deque(_Seq(p, k, _generator(s.seed, p.prompt_id, k, device))
                  for p in prompts for k in range(samples_of(p, s.n)))
    context = lm.context_length(model)
    max_len = max(len(p.tokens) for p in prompts) + s.max_new_tokens
    max_len = max_len if context is None else min(context, max_len)
    slots: list[_Seq | None] = [None] * min(s.max_batch, len(queue))
    if lm.has_cache(model):
        step = _Cached(model, len(slots), max_len, device)
    else:
        step = _Recomputed(model, device)
    done = []
    while queue or any(slots):
        fresh = [i for i, seq in enumerate(slots) if seq is None][: len(queue)]
        for i in fresh:
            slots[i] = queue.popleft()  # a free slot takes the next waiting sample
        busy = [i for i, seq in enumerate(slots) if seq is not None]
        logits = step(slots, busy, set(fresh))  # (len(busy), V)
        for row, i in enumerate(busy):
            seq = slots[i]
            token, logp = sample_token(logits[row], temperature=s.temperature, top_p=s.top_p,
                                       generator=seq.generator)
            seq.tokens.append(token)
            seq.logprobs.append(logp)
            finished = token == s.eos
            if finished or len(seq.tokens) >= s.max_new_tokens or seq.length >= max_len:
                done.append(_rollout(seq, finished, s.max_new_tokens))
                if emit is not None:
                    emit(done[-1])
                slots[i] = None  # the slot is free for the next waiting sample
    return done


class _Cached:
    """Next-token logits through the model's cache [Note: generation and scoring interface in
    executors/torch/rollout/lm.py]: one cache row per slot; a fresh slot's prompt, right-padded with
    the other fresh ones, writes its row from position 0, a busy one its last token only."""

    def __init__(self, model: torch.nn.Module, slots: int, max_len: int,
                 device: torch.device) -> None:
        self.model, self.device = model, device
        self.cache = model.new_cache(slots, max_len)

    def __call__(self, slots: list, busy: list[int], fresh: set[int]) -> torch.Tensor:
        new = [i for i in busy if i in fresh]
        old = [i for i in busy if i not in fresh]
        out: dict[int, torch.Tensor] = {}
        if new:
            prompts = [slots[i].prompt.tokens for i in new]
            rows = torch.tensor(new, device=self.device)
            logits = self._run(right_padded(prompts, self.device), torch.zeros_like(rows), rows)
            out |= {i: logits[b, len(p) - 1] for b, (i, p) in enumerate(zip(new, prompts))}
        if old:
            idx = torch.tensor([[slots[i].tokens[-1]] for i in old], device=self.device)
            start = torch.tensor([slots[i].length - 1 for i in old], device=self.device)
            logits = self._run(idx, start, torch.tensor(old, device=self.device))
            out |= {i: logits[b, -1] for b, i in enumerate(old)}
        return torch.stack([out[i] for i in busy])

    def _run(self, idx, start, rows) -> torch.Tensor:
        return lm.logits_of(self.model.forward_cached(idx, self.cache, start, rows), "generate")


class _Recomputed:
    """Next-token logits of a model without the cache protocol: the whole prefix of every busy
    slot again, right-padded (the model is causal), read at each row's last real position."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device

    def __call__(self, slots: list, busy: list[int], fresh: set[int]) -> torch.Tensor:
        seqs = [list(slots[i].prompt.tokens) + slots[i].tokens for i in busy]
        logits = lm.logits_of(self.model(right_padded(seqs, self.device)), "generate")
        last = torch.tensor([len(seq) - 1 for seq in seqs], device=logits.device)
        return logits[torch.arange(len(seqs), device=logits.device), last]


def _rollout(seq: _Seq, finished: bool, max_new_tokens: int) -> Any:
    """Its Rollout; one that stopped before EOS and max_new_tokens was cut by the context."""
    p = seq.prompt
    clipped = not finished and len(seq.tokens) < max_new_tokens
    return Rollout(prompt_id=p.prompt_id, sample=seq.sample, prompt_tokens=list(p.tokens),
                   response_tokens=list(seq.tokens), logprobs=list(seq.logprobs),
                   finished=finished, clipped=clipped, answer=getattr(p, "answer", None),
                   prompt_text=getattr(p, "text", None))


# -- the op -----------------------------------------------------------------------------------
def _generate(ctx: OpContext, prompts: Any, *weights: Any, seed: int = 0, max_batch: int = 64,
              token_budget: int = 512, step: int = 0, request: str | None = None,
              min_version: int | None = None, first_sample: int = 0, **config: Any) -> Any:
    """n rollouts of each prompt (a Prompt or a list of them; an interrupted Rollout is
    continued instead, a finished one passes through), a request to the model's rollout
    engine [Note: rollout engine in executors/torch/rollout/engine.py], which streams each sample as
    it finishes. `request` names it, for `generation` to abort; carried rollouts older than
    `min_version` are recomputed or dropped as `stale_segments` says (records.resumable,
    [Note: partial rollouts] in flowkit/runner/partial.py). `first_sample` > 0: a later round
    of each prompt's samples, n of them numbered on from there (records.sample_indices). `weights`
    (versions) only order this task after a step: the model is the one this executor holds
    by name. `seed` seeds the model's build (as in executors/torch/models/built.py) and, unless
    `sample_seed` is given, the sampling, which draws afresh each `step`. `max_batch` and
    `token_budget` size the engine when its first request makes it. A model whose folder has
    a tokenizer (an HF model's `path`) stops at that tokenizer's EOS unless `eos` names the
    token (or tokens; None: never), and its rollouts carry their text [Note: rollout text in
    engine.py]; any other model stops at EOS (byte 10). The sampling settings (n,
    max_new_tokens, temperature, top_p, top_k, eos, sample_seed, stale_segments) are the task's
    (flowkit.ops.SamplingConfig); with an `environment` (flowkit.ops.AgentConfig) each sample
    is a multi-turn trajectory [Note: multi-turn rollouts in flowkit/ops/environments.py]."""
    s, config = SamplingConfig.split(config)
    agent_settings, config = AgentConfig.split(config)
    items = list(prompts) if isinstance(prompts, (list, tuple)) else [prompts]
    items = resumable(items, min_version, s.stale_segments)
    unknown = sorted(set(config) - set(MODEL_KEYS))
    if unknown:
        raise StageError(f"generate does not take {', '.join(map(repr, unknown))}: its settings "
                         f"are {', '.join(_SETTINGS)}")
    _check_request(s.n, s.max_new_tokens, first_sample)
    branch_at = _check_branching(s, agent_settings)
    if not items:
        return []
    spec = {**config, "seed": seed, "stages": 1}
    held = held_model(ctx, spec)
    model = whole_model(ctx, spec)
    trajectories = agent_settings.environment is not None or agent_settings.program is not None
    lm.check_prompts([_as_prompt(item, trajectories) for item in items if _continues(item)],
                     lm.context_length(model))
    folder = tokenizer_folder(config)
    sample_seed = seed if s.sample_seed is None else s.sample_seed
    sampling = Sampling(max_new_tokens=int(s.max_new_tokens), temperature=float(s.temperature),
                        top_p=float(s.top_p), top_k=int(s.top_k), eos=_stop_tokens(s.eos, folder),
                        seed=int(sample_seed), step=int(step), branch_at=branch_at,
                        branches=int(s.branches),
                        branch_entropy=None if s.branch_entropy is None
                        else float(s.branch_entropy), first_sample=int(first_sample))
    if s.engine == "vllm":  # [Note: vLLM engine] in executors/torch/rollout/vllm_engine.py
        engine = vllm_engine_of(
            ctx, held, {**spec, **s.as_config(), **agent_settings.as_config()},
            max_batch=int(max_batch), aborted=_aborted(ctx),
            tokenizer=None if folder is None else load_tokenizer(folder))
        return engine.submit(items, sampling, int(s.n), key=request,
                             agent=agent_of(agent_settings, engine.tokenizer))
    engine = ctx.background.get(f"generate:{config['model']}")
    if engine is None:
        engine = ctx.background[f"generate:{config['model']}"] = Engine(
            model, version=lambda: held.version, max_batch=int(max_batch),
            token_budget=int(token_budget),
            tokenizer=None if folder is None else load_tokenizer(folder))
        engine.aborted = _aborted(ctx)  # also those aborted before this engine existed
    if not isinstance(engine, Engine):
        raise StageError(f"model {config['model']!r} generates on vLLM on this executor: its "
                         "generate ops must all name one engine")
    return engine.submit(items, sampling, int(s.n), key=request,
                         agent=agent_of(agent_settings, engine.tokenizer))


def tokenizer_folder(config: dict) -> str | None:
    """The folder of the tokenizer of the model a request names: an HF model's `path`, when
    that folder holds a tokenizer; None for any other model."""
    path = dict(config.get("model_config") or {}).get("path")
    return str(path) if path is not None and has_tokenizer(path) else None


def _stop_tokens(eos: Any, folder: str | None) -> int | tuple[int, ...] | None:
    if eos is None or isinstance(eos, (list, tuple)):  # none, or several (lists over the wire)
        return None if eos is None else tuple(int(t) for t in eos)
    if eos != MODEL_EOS:
        return int(eos)
    return EOS if folder is None else (eos_token_ids(folder) or None)


def _generation(ctx: OpContext, *_: Any, action: str, model: str | None = None,
                requests: list | None = None) -> Any:
    """Pause, resume or abort the rollout engine of `model` here (all of them without one),
    e.g. around a weight update; returns how many samples an abort handed back interrupted.
    An abort of `requests` (generate's `request` names) cuts only those, and returns
    [samples, tokens] cut."""
    engines = [engine for name, engine in ctx.background.items()
               if name.startswith("generate:") and model in (None, name.partition(":")[2])]
    if action not in ("pause", "resume", "abort"):
        raise StageError(f"generation action {action!r} is not one of pause, resume, abort")
    if requests is not None:
        if action != "abort":
            raise StageError(f"generation names requests to abort them, not to {action}")
        _aborted(ctx).update(str(r) for r in requests)  # for an engine yet to be made
        cut = [engine.abort_requests({str(r) for r in requests}) for engine in engines]
        return [sum(c[0] for c in cut), sum(c[1] for c in cut)]
    aborted = 0
    for engine in engines:
        if action == "abort":
            aborted += engine.abort()
        else:
            engine.pause(action == "pause")
    return aborted


def _aborted(ctx: OpContext) -> set:
    """The request keys aborted on this executor, shared by its engines: an abort may come
    before the request it names (waiting for its inputs) and before any engine exists."""
    return ctx.state.setdefault("aborted_requests", set())


def generate_now(ctx: OpContext, prompts: Any, **config: Any) -> list:
    """The `generate` op run to its end in this process (the engine stepped here, as an
    executor would between messages): its rollouts, in finishing order."""
    result = _generate(ctx, prompts, **config)
    return result if isinstance(result, list) else run_until_done(ctx.background, result)


_SETTINGS = (*SAMPLING_KEYS, *AGENT_KEYS, "seed", "max_batch", "token_budget", "step", "request",
             "min_version", "first_sample")


def _check_request(n: Any, max_new_tokens: Any, first_sample: Any = 0) -> None:
    if int(max_new_tokens) < 1:
        raise StageError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if int(n) < 1:
        raise StageError(f"n must be at least 1 (samples per prompt), got {n}")
    if isinstance(first_sample, bool) or not isinstance(first_sample, int) or first_sample < 0:
        raise StageError(f"first_sample must be a whole number >= 0 (the index of a later "
                         f"round's first sample), got {first_sample!r}")


def _check_branching(s: SamplingConfig, agent: AgentConfig) -> tuple[int, ...]:
    """The branch depths of tree rollouts, sorted, or what is wrong with them in one line
    [Note: tree rollouts in executors/torch/rollout/branching.py]."""
    errors = s.branching_errors()
    if s.branching and (agent.environment or agent.program):
        errors.append("tree rollouts (branch_at, branches) branch single responses, not "
                      "multi-turn trajectories: drop them or the environment")
    if errors:
        raise StageError("; ".join(errors))
    return tuple(sorted(int(d) for d in s.branch_at))


def _continues(item: Any) -> bool:
    """Whether the engine generates from `item`: a prompt, or an interrupted rollout (a
    finished one, carried, passes through: it may fill the context, cut there)."""
    return not isinstance(item, Rollout) or item.interrupted


def _as_prompt(item: Any, trajectory: bool = False) -> Any:
    """What the context check reads of an item: a prompt, or a rollout's prefix. A cut
    trajectory's prefix may fill the context: cut while its environment answered its last
    turn, the answer (done, or out of room) ends it, and one continued elsewhere without its
    episode starts again from its prompt ([Note: parked trajectories] in trajectories.py)."""
    if isinstance(item, Rollout) and trajectory:
        return Prompt(prompt_id=item.prompt_id, tokens=list(item.prompt_tokens))
    if isinstance(item, Rollout):
        return Prompt(prompt_id=item.prompt_id,
                      tokens=list(item.prompt_tokens) + list(item.response_tokens))
    return item


def register(table: OpTable) -> None:
    table.register("generate", _generate)
    table.register("generation", _generation)
