"""The rollout engine: one long-lived decoding loop per generating model on a torch executor.

The design: [Note: rollout engine], [Note: rollout text] below.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from typing import Any

import attrs
import torch

from executors.optable import Deferred
from executors.torch.device import to_device
from executors.torch.models.built import evaluating, right_padded
from executors.torch.rollout import lm
from executors.torch.rollout.branching import level_branches, levels_passed, root_sample
from executors.torch.rollout.sampling import sample_tokens, sequence_seed
from executors.torch.rollout.trajectories import Trajectories
from executors.torch.rollout.turns import Agent, EnvCalls, Episode
from flowkit.ops.configs import SAMPLING
from flowkit.ops.records import Rollout, sample_indices, samples_of

__all__ = ["Engine", "Sampling", "as_rollouts", "distinct", "free_device_memory",
           "run_all_until_done", "run_until_done", "unstarted"]


# [Note: rollout engine] A `generate` task is a request to its model's engine (a Deferred:
# executors/optable.py [Note: deferred ops]); its prompts x n become sequences waiting for a
# slot (a row of the cache). Each engine step, run between messages: drops cancelled sequences
# and forgets the cache of any sequence computed under older weights (refilled from its prefix,
# so each token's recorded version holds); gives free slots in arrival order; spends a token
# budget, decoding rows first, then prefill chunks (Sarathi-Serve) so a long prompt never stalls
# decoding; runs the model over both (the cache protocol of executors/torch/rollout/lm.py; the
# samples of one prompt fill it once [Note: shared prompts]); samples every complete row in one
# call (executors/torch/rollout/sampling.py: a draw depends only on seed and position, not on
# the batch); streams each finished sample at once. The cache holds what its sequences need
# [Note: engine cache size]; an idle engine frees it for colocated training. Requests can be
# paused, resumed or aborted ([Note: partial rollouts] in flowkit/runner/partial.py). `flowkit
# bench rollout` measures it. In full: docs/rl.md, "The rollout engine".
#
# [Note: rollout text] An engine given its model's tokenizer (an HF model folder that holds one)
# decodes each sample as it leaves: `response_text` skips special tokens, `prompt_text` is the
# prompt's `text` (what the prompt source rendered) or else its tokens decoded as they are. An
# engine without one (the built-in GPT on bytes, any model without a tokenizer) leaves both None;
# reward ops on text read such a rollout's tokens as bytes (dataflows/rewards.py).

# [Note: shared prompts] A prompt's n samples begin with the same tokens, so one of them fills the
# prompt's cache positions and the others copy them (the cache's optional `copy_prefix`: lm.py's
# cache protocol), as vLLM's and SGLang's prefix caches share a prompt's blocks: a GRPO step's
# prefill shrinks about n-fold. Each sample still runs the prompt's last token itself, for the
# logits it draws its first token from: a one-token decode over the donor's keys, where alone it
# would have read them from its own chunk's forward, so its logits equal those to rounding (as
# any two chunkings of a prefix do), and its draws, which depend only on its seed and position,
# are the same. While the prompt fills, the siblings wait instead of filling it too; a sibling
# admitted later copies what is there. Siblings decode in the donor's step as far as the token
# budget has room, the rest in the next.
# Only samples of one Prompt share (one request's `submit` item); a continued Rollout has its own
# prompt, and a trajectory's prompt is its environment's.

# [Note: engine cache size] The cache holds as many rows as the highest slot in use and as many
# positions as the longest of its sequences needs (prompt + max_new_tokens - 1; a trajectory,
# as far as it has come), not max_batch rows of the whole context (64 x 32k positions of
# Qwen2.5-0.5B are 25.8 GB in bf16). A sequence that needs more grows it to at least twice that
# size, up to max_batch rows and the context (lm.py's optional `grown` keeps what it holds; a
# cache without it is made anew and its sequences refill their prefixes, as after new weights).
# An idle engine drops it and empties torch's CUDA allocator (`free_device_memory`), so a
# neighbour on the same GPU (a colocated trainer in another process) can take the memory.

NO_VERSION = -1  # a token sampled before any load_weights: the weights the model was built with
_IDLE_WAIT_S = 0.001  # a step with nothing to compute waits this long for an environment


@attrs.frozen(kw_only=True)
class Sampling:
    """A request's settings, as `generate` resolved them from the task's SamplingConfig (whose
    defaults these are); each step of a run draws afresh from (seed, step)."""

    max_new_tokens: int
    temperature: float = SAMPLING.temperature
    top_p: float = SAMPLING.top_p
    top_k: int = SAMPLING.top_k  # 0: every token
    # the token, or tokens (a tokenizer's EOS and its generation config's), that end a sample:
    # resolved from the setting's eos (executors/torch/rollout/generate.py); None: none
    eos: int | tuple[int, ...] | None = None
    seed: int = 0  # the resolved sample seed: the setting's sample_seed, or the model's seed
    step: int = 0
    # tree rollouts [Note: tree rollouts in executors/torch/rollout/branching.py]: a sample
    # forks into `branches` samples on reaching each response depth of `branch_at`, or with
    # `branch_entropy` at its first token from there as uncertain as that [Note: entropy
    # branching in executors/torch/rollout/branching.py]
    branch_at: tuple[int, ...] = ()
    branches: int = 1
    branch_entropy: float | None = None
    first_sample: int = 0  # a later round's first sample index [Note: second rounds]

    @property
    def stop_tokens(self) -> frozenset[int]:
        if self.eos is None:
            return frozenset()
        return frozenset([self.eos] if isinstance(self.eos, int) else self.eos)

    def seed_of(self, prompt_id: int, sample: int) -> int:
        return sequence_seed(self.seed, prompt_id, sample, step=self.step)

    def next_fork_depth(self, forks: int) -> int | None:
        """The response depth at which a fixed-depth tree's sample that has forked at `forks`
        levels forks next; None: it forks no more, or the tree branches by entropy."""
        if self.branches < 2 or self.branch_entropy is not None or forks >= len(self.branch_at):
            return None
        return self.branch_at[forks]

    def continued_forks(self, tokens: int) -> int:
        """The levels a continued sample holding `tokens` response tokens has forked at: a
        fixed-depth tree's, those at or below its tokens [Note: tree rollouts in
        branching.py]; an entropy tree is never carried over."""
        if self.branches < 2 or self.branch_entropy is not None:
            return 0
        return levels_passed(tokens, self.branch_at)

    def root_of(self, root: int) -> int:
        """The sample index of a prompt's root sample `root` [Note: tree rollouts]."""
        return root_sample(root, self.branch_at, self.branches)

    def samples(self, prompt: Any, n: int) -> list[int]:
        """The sample indices of a request's fresh samples of `prompt` (records.sample_indices,
        each a tree's root)."""
        return [self.root_of(k) for k in sample_indices(prompt, n, self.first_sample)]


@attrs.define(eq=False)
class Request:
    deferred: Deferred
    sampling: Sampling
    left: int  # samples not yet done
    done: list = attrs.field(factory=list)  # Rollouts, in finishing order
    key: str | None = None  # its name, to abort it alone
    passing: list = attrs.field(factory=list)  # finished Rollouts given again: out next step
    agent: Agent | None = None  # its samples are trajectories in an environment


@attrs.define(eq=False)
class Sequence:
    """One sample being generated: its prefix (prompt + response so far) and where its cache is."""

    request: Request
    prompt: Any  # a Prompt: prompt_id, tokens, answer
    sample: int
    seed: int
    tokens: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    versions: list[int] = attrs.field(factory=list)
    slot: int | None = None
    carried: int = 0  # response tokens it came with (a continued Rollout's)
    filled: int = 0  # prefix positions whose keys are in its cache row
    cache_version: int | None = None
    # a trajectory's [Note: multi-turn rollouts in flowkit/ops/environments.py]: its episode,
    # which response tokens the model sampled (1) or the environment gave (0), and whether it
    # holds its slot while its environment steps (keep_cache)
    episode: Episode | None = None
    mask: list[int] = attrs.field(factory=list)
    on_hold: bool = False
    call: tuple | None = None  # its environment call, when an abort took it from the engine
    # a tree rollout's branch [Note: tree rollouts in executors/torch/rollout/branching.py]: the
    # sample it forked from, the response tokens it shares with it, and, until its cache row
    # has them, the sequence whose row it copies them from
    branch_of: int | None = None
    shared_tokens: int = 0
    donor: Sequence | None = None
    forks: int = 0  # levels of its tree its path has forked at (branch_at's index it is at)

    @property
    def prefix(self) -> list[int]:
        return list(self.prompt.tokens) + self.tokens

    @property
    def length(self) -> int:  # len(prefix), without building it: read every step
        return len(self.prompt.tokens) + len(self.tokens)

    @property
    def last_token(self) -> int:
        return self.tokens[-1] if self.tokens else self.prompt.tokens[-1]


class Engine(Trajectories):
    """The decoding loop of one model held by this executor (a Background: busy, step)."""

    def __init__(self, model: torch.nn.Module, *, version: Any, max_batch: int = 64,
                 token_budget: int = 512, max_len: int = 2048, tokenizer: Any = None) -> None:
        self.model = model
        self.tokenizer = tokenizer  # decodes the rollouts' text [Note: rollout text]
        self.version = version  # a callable: the version of the weights the model holds now
        self.max_batch, self.token_budget = max(1, max_batch), max(1, token_budget)
        self.context = lm.context_length(model)
        self.cached = lm.has_cache(model)
        self.reads_last = lm.reads_last(model)  # its prefills compute one position's logits
        self.max_len = self.context or max_len  # the longest sequence, the cache's bound
        self.cache = None  # made on first use, as large as needed [Note: engine cache size]
        self.cache_shape = (0, 0)  # its (rows, positions)
        self.slots: list[Sequence | None] = [None] * self.max_batch
        self.waiting: deque[Sequence] = deque()
        self.passing: list[Request] = []  # requests with finished Rollouts to hand back
        self.aborted: set[str] = set()  # request keys aborted, also before they arrived
        self.paused = False
        self.env_calls = EnvCalls()  # trajectories' environment calls, in threads
        self.parked: dict[tuple[int, int], Any] = {}  # aborted trajectories' episodes
        self.device = next(model.parameters()).device
        self.stats = {"steps": 0, "decode_tokens": 0, "prefill_tokens": 0, "cache_releases": 0,
                      "cache_grown": 0, "shared_prefix_tokens": 0}

    # -- requests ------------------------------------------------------------------------------
    def submit(self, items: list, sampling: Sampling, n: int, *, key: str | None = None,
               agent: Agent | None = None) -> Deferred:
        """n samples of each Prompt, or the continuation of each interrupted Rollout (one
        sample each, from its prefix), as one request; a finished Rollout passes through.
        With `agent`, each sample is a trajectory in its own environment."""
        lm.check_prompts([item for item in items if not isinstance(item, Rollout)], self.context)
        request = Request(deferred=Deferred(), sampling=sampling, left=0, key=key, agent=agent)
        if key is not None and key in self.aborted:  # its abort came first: it ends at once
            request.passing = [unstarted(s) for item in items
                               for s in as_rollouts(item, n, sampling)]
            request.left = len(request.passing)
            self.passing.append(request)
            return request.deferred
        for item in items:
            if isinstance(item, Rollout) and not item.interrupted:
                request.passing.append(item)
                request.left += 1
                self.passing.append(request)
                continue
            if isinstance(item, Rollout) and agent is not None:
                self._resume(request, item)  # [Note: parked trajectories] in trajectories.py
                request.left += 1
                continue
            if isinstance(item, Rollout):
                self.waiting.append(self._continued(request, item))
                request.left += 1
                continue
            for sample in sampling.samples(item, n):
                seq = Sequence(request, item, sample, sampling.seed_of(item.prompt_id, sample))
                request.left += 1
                if agent is None:
                    self.waiting.append(seq)
                else:
                    self._open(seq)
        return request.deferred

    def _continued(self, request: Request, rollout: Rollout) -> Sequence:
        prompt = self._prompt_of(rollout)
        versions = list(rollout.versions) or [NO_VERSION] * len(rollout.response_tokens)
        return Sequence(request, prompt, rollout.sample,
                        request.sampling.seed_of(rollout.prompt_id, rollout.sample),
                        tokens=list(rollout.response_tokens), logprobs=list(rollout.logprobs),
                        versions=versions, carried=len(rollout.response_tokens),
                        branch_of=rollout.branch_of, shared_tokens=rollout.shared_tokens,
                        forks=request.sampling.continued_forks(len(rollout.response_tokens)))

    def _sequence(self, *args: Any, **fields: Any) -> Sequence:
        return Sequence(*args, **fields)

    def pause(self, paused: bool = True) -> None:
        """Stop (or restart) stepping; sequences keep their tokens and their cache."""
        self.paused = paused

    def abort(self) -> int:
        """Every request's unfinished samples back now, `interrupted`; returns how many."""
        self._environments_answered()  # answered trajectories cut between steps: their state
        live = distinct([s for s in self.slots if s is not None] + list(self.waiting)
                     + self.env_calls.drop(lambda s: False))
        self.slots = [None] * self.max_batch
        self.waiting.clear()
        for seq in live:
            self._finish(seq, finished=False, interrupted=True)
        self._release_if_empty()
        return len(live)

    def abort_requests(self, keys: set[str]) -> tuple[int, int]:
        """The requests named `keys` end now, their unfinished samples `interrupted`;
        returns (samples, response tokens) cut."""
        self.aborted |= keys  # a request still on its way ends as it arrives
        self._environments_answered()  # answered trajectories cut between steps: their state
        cut = distinct([s for s in [*self.slots, *self.waiting]
                     if s is not None and s.request.key in keys]
                    + self.env_calls.drop(lambda s: s.request.key not in keys))
        self.slots = [None if s is not None and s.request.key in keys else s for s in self.slots]
        self.waiting = deque(s for s in self.waiting if s.request.key not in keys)
        for seq in cut:
            self._finish(seq, finished=False, interrupted=True)
        self._release_if_empty()
        return len(cut), sum(len(seq.tokens) - seq.carried for seq in cut)

    # -- the Background ------------------------------------------------------------------------
    def busy(self) -> bool:
        return not self.paused and (bool(self.waiting) or any(self.slots) or bool(self.passing)
                                    or bool(self.env_calls))

    def step(self) -> None:
        """One iteration. A failure of the model fails the requests it was running, not the
        engine: they were in one batch, so they fail together."""
        try:
            self._step()
            self._release_if_empty()
        except Exception as error:
            live = distinct([s for s in self.slots if s is not None] + list(self.waiting)
                         + self.env_calls.drop(lambda s: False))
            self.slots, self.waiting = [None] * self.max_batch, deque()
            for request in {id(s.request): s.request for s in live}.values():
                if not (request.deferred.finished or request.deferred.cancelled):
                    request.deferred.fail(error)

    def _release_if_empty(self) -> None:
        if self.cache is not None and self._empty():
            self.cache, self.cache_shape = None, (0, 0)  # [Note: engine cache size]
            self.stats["cache_releases"] += 1
            free_device_memory(self.device)

    def _empty(self) -> bool:
        """No sequence anywhere: nothing holds a row of the cache (paused or not)."""
        return not (self.waiting or any(self.slots) or self.passing or self.env_calls)

    def _step(self) -> None:
        self._pass_through()
        self._drop_cancelled()
        self._environments_answered()
        self._refill_stale()
        self._admit()
        with evaluating(self.model):  # one mode switch a step: the plan may make the cache
            decoding, chunks, copies = self._plan()
            idle = not (decoding or chunks) and bool(self.env_calls)
            # the next-token logits of the rows whose prefix is in
            logits = {} if idle else self._forward(decoding, chunks, copies)
        if idle:
            # every live trajectory waits for its environment: wait for one to answer, the
            # GIL released, rather than spin (an agent program's threads need it: [Note:
            # agent programs] in endpoint.py); short, so the executor still serves its sockets
            self.env_calls.wait(_IDLE_WAIT_S)
            return
        if logits:
            rows = [seq for seq in self.slots if seq is not None and id(seq) in logits]
            self._sample(rows, torch.stack([logits[id(seq)] for seq in rows]))
        self.stats["steps"] += 1

    def _drop_cancelled(self) -> None:
        for i, seq in enumerate(self.slots):
            if seq is not None and seq.request.deferred.cancelled:
                self.slots[i] = None
        self.waiting = deque(s for s in self.waiting if not s.request.deferred.cancelled)
        for seq in self.env_calls.drop(lambda s: not s.request.deferred.cancelled):
            seq.episode.close()

    def _refill_stale(self) -> None:
        now = self.version()
        for seq in self.slots:
            if seq is not None and seq.cache_version != now:
                seq.filled, seq.cache_version = 0, now  # its prefix again, under these weights

    def _admit(self) -> None:
        for i, seq in enumerate(self.slots):
            if seq is None and self.waiting:
                seq = self.slots[i] = self.waiting.popleft()
                seq.slot, seq.filled, seq.cache_version = i, 0, self.version()

    def _plan(self) -> tuple[list[Sequence], list[tuple[Sequence, int, int]], list[_Copy]]:
        """(rows that decode one token, (row, start, stop) prefill chunks, prompt copies to make
        once the chunks are in) within the budget, decodes first. `filled` positions of a row's
        prefix have their keys in its cache row; a row filled up to its last token decodes that
        token, the others fill a chunk."""
        live = [s for s in self.slots if s is not None and not s.on_hold]
        if not self.cached:  # no cache to fill: every row runs its whole prefix
            return live, [], []
        # under _step's `evaluating`: a cache in the dtype its forwards compute in
        self._fit_cache()  # before `filled` is read: a cache made anew refills its rows
        self._share_branches(live)
        waiting = self._share_prompts(live)  # donor id -> the copy its siblings wait for
        held = {id(seq) for copy in waiting.values() for seq in copy.takers}
        decoding = [s for s in live if s.filled == s.length - 1]
        budget = self.token_budget - len(decoding)
        chunks = []
        for seq in live:
            if seq.filled < seq.length - 1 and budget > 0 and id(seq) not in held:
                stop = min(seq.length, seq.filled + budget)
                chunks.append((seq, seq.filled, stop))
                budget -= stop - seq.filled
        # siblings whose donor fills the rest of their shared prompt in this step's chunks copy
        # it after them and decode in this step too, as many as the budget has tokens left
        copies = []
        for seq, _, stop in chunks:
            copy = waiting.get(id(seq))
            if copy is not None and stop >= copy.length and budget > 0:
                copies.append(attrs.evolve(copy, takers=copy.takers[:budget]))
                budget -= len(copies[-1].takers)
        return decoding, chunks, copies

    def _share_prompts(self, live: list[Sequence]) -> dict[int, _Copy]:
        """[Note: shared prompts] Copy each prompt's filled cache positions from the sample that
        has most of them to its siblings; what the siblings still waiting need, by donor id."""
        siblings: dict[int, list[Sequence]] = {}
        if callable(getattr(self.cache, "copy_prefix", None)):
            for seq in live:  # a trajectory's prompt may be its own: only plain samples share
                if seq.episode is None and len(seq.prompt.tokens) > 1:
                    siblings.setdefault(id(seq.prompt), []).append(seq)
        waiting: dict[int, _Copy] = {}
        for group in (g for g in siblings.values() if len(g) > 1):
            shared = len(group[0].prompt.tokens) - 1  # each runs the last itself: its logits
            donor = max(group, key=lambda seq: min(seq.filled, shared))
            self._copy(_Copy(donor, [s for s in group if s.filled < min(donor.filled, shared)],
                             min(donor.filled, shared)))
            takers = [s for s in group if s is not donor and s.filled < shared]
            if takers:
                waiting[id(donor)] = _Copy(donor, takers, shared)
        return waiting

    def _share_branches(self, live: list[Sequence]) -> None:
        """[Note: tree rollouts] A new branch copies its prefix but its last token from the
        row of the sample it forked from, if that one still holds it under the same weights;
        otherwise it fills its prefix itself, to the same keys."""
        for seq in live:
            donor, seq.donor = seq.donor, None
            length = seq.length - 1  # it runs its last token itself: its logits
            if (donor is None or seq.filled > 0 or donor.slot is None
                    or self.slots[donor.slot] is not donor or donor.filled < length
                    or donor.cache_version != seq.cache_version
                    or not callable(getattr(self.cache, "copy_prefix", None))):
                continue
            self.cache.copy_prefix(donor.slot, [seq.slot], length)
            seq.filled = length
            self.stats["shared_prefix_tokens"] += length

    def _fit_cache(self) -> None:
        """Make or grow the cache to hold every sequence in a slot [Note: engine cache size]."""
        held = [s for s in self.slots if s is not None]
        if not held:
            return
        rows = max(seq.slot for seq in held) + 1
        length = min(self.max_len, max(_positions_needed(seq) for seq in held))
        if self.cache is None:
            self.cache, self.cache_shape = self.model.new_cache(rows, length), (rows, length)
            return
        have_rows, have_length = self.cache_shape
        if rows <= have_rows and length <= have_length:
            return
        shape = (_grown(have_rows, rows, self.max_batch), _grown(have_length, length, self.max_len))
        if callable(getattr(self.cache, "grown", None)):
            self.cache = self.cache.grown(*shape)
        else:  # made anew: every row refills its prefix, as under new weights
            self.cache = None  # the old one's memory first
            self.cache = self.model.new_cache(*shape)
            for seq in held:
                seq.filled = 0
        self.cache_shape = shape
        self.stats["cache_grown"] += 1

    def _copy(self, copy: _Copy) -> None:
        if copy.takers:
            self.cache.copy_prefix(copy.donor.slot, [s.slot for s in copy.takers], copy.length)
            for seq in copy.takers:
                self.stats["shared_prefix_tokens"] += copy.length - seq.filled
                seq.filled = copy.length

    # -- the model -----------------------------------------------------------------------------
    def _forward(self, decoding: list[Sequence], chunks: list[tuple[Sequence, int, int]],
                 copies: list[_Copy]) -> dict[int, torch.Tensor]:
        """The next-token logits of every row whose prefix is now all in (by id)."""
        if not self.cached:
            return self._recompute(decoding)
        out: dict[int, torch.Tensor] = {}  # the cache is there: _plan made it if it was not
        for batch in _fitting(chunks, self.cache_shape[1]):
            parts = [seq.prefix[start:stop] for seq, start, stop in batch]
            logits = self._cached(right_padded(parts, torch.device("cpu")),
                                  [c[1] for c in batch], [seq for seq, _, _ in batch],
                                  [len(part) - 1 for part in parts])
            for b, (seq, _, stop) in enumerate(batch):
                seq.filled = stop
                if stop == seq.length:  # the chunk reached its last token
                    out[id(seq)] = logits[b]
        for copy in copies:  # their donors' chunks are in: copied, they decode now
            self._copy(copy)
            decoding = decoding + [s for s in copy.takers if s.filled == s.length - 1]
        if decoding:
            idx = torch.tensor([[s.last_token] for s in decoding])
            logits = self._cached(idx, [s.filled for s in decoding], decoding, [0] * len(decoding))
            for b, seq in enumerate(decoding):
                out[id(seq)] = logits[b]
                seq.filled += 1
        self.stats["decode_tokens"] += len(decoding)
        self.stats["prefill_tokens"] += sum(stop - start for _, start, stop in chunks)
        return out

    def _cached(self, idx: torch.Tensor, starts: list[int], rows: list[Sequence],
                last: list[int]) -> torch.Tensor:
        """Logits (B, V) of each row's token `last` of `idx` (B, T), given on the host and
        moved without a wait ([Note: transfers without a wait] in executors/torch/device.py);
        a model that reads them computes no others (lm.py's optional `last`)."""
        start, last_at = torch.tensor(starts), torch.tensor(last)
        # the slots stay on the host: the model reads them as a slice when they are its first
        # rows in order [Note: live cache window in executors/torch/models/gpt.py]
        idx, slots = to_device(idx, self.device), torch.tensor([s.slot for s in rows])
        if self.reads_last:  # it takes `start` on the host too
            out = self.model.forward_cached(idx, self.cache, start, slots, last=last_at)
            return lm.logits_of(out, "generate")[:, 0]
        out = self.model.forward_cached(idx, self.cache, to_device(start, self.device), slots)
        logits = lm.logits_of(out, "generate")
        return logits[torch.arange(len(rows), device=logits.device), to_device(last_at,
                                                                               logits.device)]

    def _recompute(self, rows: list[Sequence]) -> dict[int, torch.Tensor]:
        seqs = [s.prefix for s in rows]
        logits = lm.logits_of(self.model(right_padded(seqs, self.device)), "generate")
        self.stats["prefill_tokens"] += sum(len(s) for s in seqs)
        return {id(s): logits[b, len(seq) - 1] for b, (s, seq) in enumerate(zip(rows, seqs))}

    # -- sampling and finishing ----------------------------------------------------------------
    def _sample(self, rows: list[Sequence], logits: torch.Tensor) -> None:
        settings = [s.request.sampling for s in rows]
        stops = [st.stop_tokens for st in settings]
        by_entropy = any(st.branch_entropy is not None for st in settings)
        drawn = sample_tokens(
            logits,
            temperature=torch.tensor([st.temperature for st in settings], dtype=torch.float64),
            top_p=torch.tensor([st.top_p for st in settings], dtype=torch.float64),
            top_k=torch.tensor([st.top_k for st in settings], dtype=torch.int64),
            seeds=torch.tensor([s.seed for s in rows], dtype=torch.int64),
            positions=torch.tensor([len(s.tokens) for s in rows], dtype=torch.int64),
            entropy=by_entropy)
        version = self._version_now()
        # one copy to the host, the step's one wait for the device (a token id < 2^53 is exact)
        tokens, logprobs, *spread = torch.stack([drawn[0].to(torch.float64), *drawn[1:]]).tolist()
        entropies = spread[0] if spread else itertools.repeat(0.0)  # read by entropy trees only
        for seq, token, logp, st, stop, entropy in zip(rows, map(int, tokens), logprobs, settings,
                                                       stops, entropies):
            seq.tokens.append(token)
            seq.logprobs.append(logp)
            seq.versions.append(version)
            if st.branch_entropy is not None and self._uncertain(seq, st, entropy):
                self._fork(seq, len(seq.tokens) - 1)  # at the token just drawn, however it ends
            eos = token in stop
            full = self.context is not None and seq.length >= self.context
            if seq.episode is not None:
                seq.mask.append(1)
                self._after_agent_token(seq, eos, full)
            elif eos or len(seq.tokens) >= st.max_new_tokens or full:
                self.slots[seq.slot] = None
                self._finish(seq, finished=eos, interrupted=False)
            elif (st.branch_entropy is None and st.branches > 1 and seq.forks < len(st.branch_at)
                  and len(seq.tokens) == st.branch_at[seq.forks]):
                self._fork(seq, len(seq.tokens))

    @staticmethod
    def _uncertain(seq: Sequence, st: Sampling, entropy: float) -> bool:
        """Whether `seq` forks at the token it just drew: a level is left, the token lies at or
        past the level's depth and past the one `seq` was forked at, and its distribution's
        entropy reaches the threshold [Note: entropy branching in branching.py]."""
        at = len(seq.tokens) - 1
        return (st.branches > 1 and seq.forks < len(st.branch_at) and at >= st.branch_at[seq.forks]
                and at > seq.shared_tokens and entropy >= st.branch_entropy)

    def _fork(self, seq: Sequence, depth: int) -> None:
        """[Note: tree rollouts] `seq`'s new branches, holding its first `depth` response
        tokens, first in line for a slot, so its row still holds their prefix when they take
        one."""
        st, level = seq.request.sampling, seq.forks
        seq.forks += 1
        for sample in reversed(level_branches(seq.sample, level, len(st.branch_at), st.branches)):
            self.waiting.appendleft(Sequence(
                seq.request, seq.prompt, sample, st.seed_of(seq.prompt.prompt_id, sample),
                tokens=seq.tokens[:depth], logprobs=seq.logprobs[:depth],
                versions=seq.versions[:depth], carried=depth, branch_of=seq.sample,
                shared_tokens=depth, donor=seq, forks=seq.forks))
            seq.request.left += 1

    def _finish(self, seq: Sequence, *, finished: bool, interrupted: bool,
                clipped: bool | None = None) -> None:
        request, st = seq.request, seq.request.sampling
        if clipped is None:
            clipped = not finished and not interrupted and len(seq.tokens) < st.max_new_tokens
        ep, saved = seq.episode, None
        if ep is not None and interrupted:
            saved = self._park(seq)  # a later request may continue it [Note: parked trajectories]
        elif ep is not None:
            ep.close()
        trajectory = {} if ep is None else {
            "env_state": saved,
            "response_mask": seq.mask, "turns": ep.turns, "env_reward": ep.reward,
            "env_error": ep.error, "env_info": {**ep.info, "env_seconds": ep.seconds},
            "prompt_messages": getattr(seq.prompt, "messages", None)}
        rollout = Rollout(prompt_id=seq.prompt.prompt_id, sample=seq.sample,
                          prompt_tokens=list(seq.prompt.tokens), response_tokens=seq.tokens,
                          logprobs=seq.logprobs, versions=seq.versions, finished=finished,
                          clipped=clipped, interrupted=interrupted,
                          answer=getattr(seq.prompt, "answer", None),
                          branch_of=seq.branch_of, shared_tokens=seq.shared_tokens,
                          **self._texts(seq.prompt, seq.tokens), **trajectory)
        self._deliver(request, rollout)

    def _version_now(self) -> int:
        """What a token sampled now records as its weights version."""
        version = self.version()
        return NO_VERSION if version is None else version



@attrs.frozen
class _Copy:
    """A prompt's first `length` cache positions, from its donor's row to its takers' rows."""

    donor: Sequence
    takers: list[Sequence]
    length: int


def _positions_needed(seq: Sequence) -> int:
    """Cache positions a sequence fills by its end [Note: engine cache size]: its last token
    is never run, so prompt + max_new_tokens - 1, or as far as it has come (a trajectory)."""
    return max(len(seq.prompt.tokens) + seq.request.sampling.max_new_tokens - 1, seq.length)


def _grown(have: int, need: int, most: int) -> int:
    """A cache dimension of `have` that must hold `need`: at least doubled, so a sequence that
    grows step by step (a trajectory) regrows it a logarithmic number of times; `most` at most."""
    return have if need <= have else min(most, max(need, 2 * have))


def free_device_memory(device: torch.device) -> None:
    """Hand the blocks torch's CUDA allocator keeps for this process back to the GPU, for a
    neighbour on it [Note: engine cache size]; nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def distinct(seqs: list) -> list:
    """`seqs` without repeats: a trajectory waiting for its environment may hold its slot
    (keep_cache) and be in both places (either engine's samples)."""
    return list({id(seq): seq for seq in seqs}.values())


def as_rollouts(item: Any, n: int, sampling: Sampling | None = None) -> list:
    """A request's samples as Rollouts: a Prompt's n roots, each with no response yet (their
    indices as `sampling`'s trees number them [Note: tree rollouts in branching.py])."""
    if isinstance(item, Rollout):
        return [item]
    samples = range(samples_of(item, n)) if sampling is None else sampling.samples(item, n)
    return [Rollout(prompt_id=item.prompt_id, sample=k, prompt_tokens=list(item.tokens),
                    response_tokens=[], logprobs=[], answer=getattr(item, "answer", None),
                    prompt_text=getattr(item, "text", None))
            for k in samples]


def unstarted(rollout: Rollout) -> Rollout:
    """A sample of an aborted request, as it stands: finished, or interrupted where it got."""
    if rollout.finished and rollout.response_tokens and not rollout.interrupted:
        return rollout
    return attrs.evolve(rollout, finished=False, interrupted=True)


def _fitting(chunks: list[tuple[Sequence, int, int]],
             max_len: int) -> list[list[tuple[Sequence, int, int]]]:
    """Prefill chunks in forwards whose rows fit their cache rows: right-padded to the widest
    chunk, a row's padding takes the positions after its own chunk, so a short chunk late in
    its sequence (a trajectory's observation) goes in a forward of its own when the widest
    chunk beside it would run past the cache's end."""
    if not chunks or (max(c[1] for c in chunks) + max(c[2] - c[1] for c in chunks)
                      <= max_len):
        return [chunks] if chunks else []
    batches: list[list[tuple[Sequence, int, int]]] = []
    width = start = 0
    for chunk in sorted(chunks, key=lambda c: c[2] - c[1]):
        grown_width, grown_start = max(width, chunk[2] - chunk[1]), max(start, chunk[1])
        if batches and grown_start + grown_width <= max_len:
            batches[-1].append(chunk)
            width, start = grown_width, grown_start
        else:
            batches.append([chunk])
            width, start = chunk[2] - chunk[1], chunk[1]
    return batches


def run_until_done(backgrounds: dict, deferred: Deferred,
                   on_item: Callable[[Any], None] | None = None) -> Any:
    """Step `backgrounds` (an OpContext's) until `deferred` finishes, in this process, giving
    each item it streams to `on_item`; its result, or its error raised. What an executor does
    between messages, for tests and the in-process benchmark."""
    return run_all_until_done(backgrounds, [deferred], on_item)[0]


def run_all_until_done(backgrounds: dict, deferreds: list[Deferred],
                       on_item: Callable[[Any], None] | None = None) -> list:
    """As `run_until_done`, for requests that run together: their results, in order."""
    boxes: list[dict[str, Any]] = [{} for _ in deferreds]
    for deferred, box in zip(deferreds, boxes):
        deferred.bind(_Collect(box, on_item))
    while not all(d.finished for d in deferreds):
        busy = [b for b in backgrounds.values() if b.busy()]
        if not busy:
            raise RuntimeError("nothing is running that could finish these requests")
        for background in busy:
            background.step()
    for box in boxes:
        if "error" in box:
            raise box["error"]
    return [box["result"] for box in boxes]


class _Collect:
    def __init__(self, box: dict, on_item: Callable[[Any], None] | None) -> None:
        self.box, self.on_item = box, on_item

    def emit(self, item: Any) -> None:
        if self.on_item is not None:
            self.on_item(item)

    def done(self, result: Any) -> None:
        self.box["result"] = result

    def fail(self, error: BaseException) -> None:
        self.box["error"] = error
