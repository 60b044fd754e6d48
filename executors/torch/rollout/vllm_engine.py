"""The vLLM rollout engine: a `generate` whose SamplingConfig.engine is "vllm" runs on a vLLM engine
this executor holds, behind the same op contract as flowkit's own engine (engine.py).

The design: [Note: vLLM engine] below; docs/rl.md, "The vLLM engine". vllm is imported when the
first such request makes the engine, never at import: flowkit runs without it.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch

from executors.optable import Deferred, OpContext
from executors.settings import switch
from executors.torch.errors import StageError
from executors.torch.lora import adapted_layers
from executors.torch.rollout import lm
from executors.torch.rollout.branching import level_branches
from executors.torch.rollout.engine import (
    NO_VERSION,
    Request,
    Sampling,
    as_rollouts,
    distinct,
    free_device_memory,
    unstarted,
)
from executors.torch.rollout.trajectories import Trajectories
from executors.torch.rollout.turns import Agent, EnvCalls, Episode, step_episode
from flowkit.ops.records import Rollout
from flowkit.ops.rollout_engines import vllm_logprobs_mode, vllm_problems

__all__ = ["VLLMEngine", "engine_args", "sampling_params", "vllm_engine_of", "weights_fingerprint"]


# [Note: vLLM engine] One vllm LLMEngine per generating model on an executor, its engine core in
# this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so that one `step()` of the executor's
# Background is one scheduler iteration of vLLM, run between messages like the own engine's.
# Each sample (prompt x n, or a continued Rollout) is a vLLM request of its own, n=1, with its
# own seed (sequence_seed, as the own engine's), streamed with DELTA outputs: every token comes
# back in the step that sampled it, with its sampler log-prob, and is stamped with the weights
# version held then; a finished sample leaves at once. Weights: the executor holds the model in
# torch too (load_weights lands there, or the colocated trainer updates it in place); before
# each step the engine compares the held parameters' version counters with those it loaded and,
# if they moved, feeds them to vLLM's workers (`reload_weights`, no file) and resets the prefix
# cache with running requests preempted, so they refill under the new weights, as the own
# engine refills its cache rows. Log-probs are flowkit's convention through the logprobs_mode
# that gives it (flowkit/ops/rollout_engines.py). A trajectory is a vLLM request a model turn,
# token ids in and out; between turns trajectories.py runs its environment as for the own engine.

# [Note: vLLM trees] Tree rollouts at fixed depths ([Note: tree rollouts] in branching.py): a
# sample's request asks for tokens up to its next branch depth only; when it ends there by
# length, the sample forks as in the own engine (the same indices and seeds), and the parent and
# its new branches go on as requests over prompt + the shared tokens, which vLLM's prefix cache
# finds computed (its full blocks). A continuation draws from seed + tokens so far, as every
# continued request here does. Branching by entropy needs each token's whole-vocabulary entropy,
# which vLLM does not return: refused (flowkit/ops/rollout_engines.py).

# [Note: vLLM sleeps beside a trainer] vLLM takes its share of a GPU for weights and KV cache
# when it starts (FLOWKIT_VLLM_GPU_MEMORY, half by default) and keeps it. So every training F
# on the executor first asks its engines to make room (`make_room` in executors/torch/device.py):
# an idle vLLM engine sleeps at level 2, its weights and KV cache handed back to the GPU. The
# next request wakes the weights, reloads them from the held model (the step changed them
# anyway, and a copy on the GPU costs little), then the KV cache. An executor that never trains
# never sleeps, and a busy engine is left alone. Sleep mode is CUDA's (vLLM's allocator maps its
# memory itself): on a CPU nothing sleeps; FLOWKIT_VLLM_SLEEP=0 turns it off. As verl runs a
# colocated vLLM.
_MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"
# a GPU's share vLLM takes for weights and KV cache: a colocated trainer needs the rest
GPU_MEMORY_ENV = "FLOWKIT_VLLM_GPU_MEMORY"
# on a CPU, the KV cache's MiB (vLLM would otherwise reserve a share of the host's memory and
# refuse to start when other processes hold it)
CPU_KV_CACHE_ENV = "FLOWKIT_VLLM_KV_CACHE_MIB"
SLEEP_ENV = "FLOWKIT_VLLM_SLEEP"  # 0: vLLM keeps its GPU memory, idle or not
_IDLE_WAIT_S = 0.001  # a step with only environments to wait for waits this long


def engine_args(*, folder: str, dtype: str, device: str, seed: int, max_batch: int,
                logprobs_mode: str) -> dict[str, Any]:
    """vllm.EngineArgs' keywords for a model folder on `device`."""
    on_gpu = device.startswith("cuda")
    args = {"model": str(folder), "tokenizer": str(folder), "dtype": dtype, "seed": int(seed),
            "max_num_seqs": int(max_batch), "logprobs_mode": logprobs_mode,
            "enable_prefix_caching": True, "disable_log_stats": True,
            "skip_tokenizer_init": True,  # token ids in and out; flowkit decodes the texts
            "enforce_eager": not on_gpu}  # CUDA graphs on a GPU; nothing to capture on a CPU
    if on_gpu:
        args["gpu_memory_utilization"] = float(os.environ.get(GPU_MEMORY_ENV, "0.5"))
        args["enable_sleep_mode"] = sleep_mode(device)  # [Note: vLLM sleeps beside a trainer]
    else:
        args["kv_cache_memory_bytes"] = int(os.environ.get(CPU_KV_CACHE_ENV, "256")) << 20
    return args


def sleep_mode(device: str) -> bool:
    """Whether vLLM on `device` starts with its sleep mode and sleeps when a training op asks
    for room [Note: vLLM sleeps beside a trainer]: on a GPU, unless FLOWKIT_VLLM_SLEEP=0."""
    return device.startswith("cuda") and switch(os.environ, SLEEP_ENV, True)


def sampling_params(sampling: Sampling, *, seed: int, max_tokens: int) -> dict[str, Any]:
    """vllm.SamplingParams' keywords for one sample: flowkit's settings one to one; the stop
    tokens are exactly flowkit's (ignore_eos: vLLM adds none of its own), one log-prob a token
    (the sampled one's), tokens streamed as they come."""
    return {"n": 1, "temperature": float(sampling.temperature), "top_p": float(sampling.top_p),
            "top_k": int(sampling.top_k), "seed": int(seed),
            "max_tokens": int(max_tokens), "stop_token_ids": sorted(sampling.stop_tokens),
            "ignore_eos": True, "logprobs": 0, "detokenize": False}


def weights_fingerprint(model: torch.nn.Module, version: int | None) -> tuple:
    """What changes when the held weights change: the version load_weights recorded, and each
    parameter's in-place version counter (an optimizer step or a copy into it bumps it)."""
    return (version, tuple(p._version for p in model.parameters()))


def vllm_engine_of(ctx: OpContext, held: Any, config: dict[str, Any], *, max_batch: int,
                   aborted: set[str], tokenizer: Any) -> VLLMEngine:
    """The vLLM engine of the model `config` names on this executor, started by its first
    request; what vLLM cannot serve (flowkit/ops/rollout_engines.py) is refused first, in one
    line, as the run refuses it before it starts."""
    device = ctx.device if ctx.device not in ("", "auto") else "cpu"
    model_config = dict(config.get("model_config") or {})
    problems = vllm_problems(model=config["model"], build=config["build"],
                             model_config=model_config, sampling=config,
                             dtype=config.get("dtype", "float32"), lora=config.get("lora"),
                             device=device)
    if problems:
        raise StageError("; ".join(problems))
    name = f"generate:{config['model']}"
    engine = ctx.background.get(name)
    if engine is not None and not isinstance(engine, VLLMEngine):
        raise StageError(f"model {config['model']!r} generates on flowkit's engine on this "
                         "executor: its generate ops must all name one engine")
    if engine is None:
        modes = vllm_logprobs_mode(config.get("temperature", 1.0), config.get("top_p", 1.0),
                                   config.get("top_k", 0))
        whole = held.parts[0]
        engine = ctx.background[name] = VLLMEngine(
            whole, folder=str(model_config["path"]), version=lambda: held.version,
            device=device, dtype=config.get("dtype", "float32"), seed=int(config.get("seed", 0)),
            max_batch=max_batch, logprobs_mode=modes[0], tokenizer=tokenizer,
            context=lm.context_length(whole),
            may_sleep=sleep_mode(device))
        engine.aborted = aborted  # also those aborted before this engine existed
    return engine


@attrs.define(eq=False)
class _Sample:
    request: Request
    prompt: Any  # a Prompt
    sample: int
    seed: int
    tokens: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    versions: list[int] = attrs.field(factory=list)
    carried: int = 0  # response tokens it came with (a continued Rollout's)
    limit: int = 0  # response tokens it may have in all: max_new_tokens, or the context's room
    rid: str | None = None  # its vLLM request id, once added
    # a trajectory's, as the own engine's Sequence (engine.py): its episode, which response
    # tokens the model sampled (1) or the environment gave (0); each model turn is a vLLM
    # request of its own over the whole prefix (its prefix cache keeps the earlier turns)
    episode: Episode | None = None
    mask: list[int] = attrs.field(factory=list)
    call: tuple | None = None  # its environment call, when an abort took it from the engine
    slot: None = None  # vLLM holds its cache: never a slot of the own engine's
    on_hold: bool = False
    # a tree rollout's, as the own engine's Sequence [Note: vLLM trees]
    branch_of: int | None = None
    shared_tokens: int = 0
    forks: int = 0  # levels of its tree its path has forked at


class VLLMEngine(Trajectories):
    """A Background over one vllm LLMEngine (busy, step), with the own engine's control: submit,
    pause, abort, abort_requests (generate.py's `generation` op calls them); multi-turn
    trajectories as the own engine runs them (trajectories.py), a vLLM request a model turn."""

    def __init__(self, model: torch.nn.Module, *, folder: str, version: Callable[[], Any],
                 device: str, dtype: str, seed: int, max_batch: int, logprobs_mode: str,
                 tokenizer: Any = None, context: int | None = None,
                 llm: Any = None, may_sleep: bool = False) -> None:
        self.model, self.version, self.tokenizer = model, version, tokenizer
        self.device = torch.device(device)
        self.may_sleep = may_sleep  # [Note: vLLM sleeps beside a trainer]
        self.asleep = False
        self.context, self.logprobs_mode = context, logprobs_mode
        self.llm = llm if llm is not None else _start(engine_args(
            folder=folder, dtype=dtype, device=device, seed=seed, max_batch=max_batch,
            logprobs_mode=logprobs_mode))
        # a request's vllm.SamplingParams from sampling_params' keywords (a test's stand-in
        # for vllm takes them as they are)
        self.make_params: Callable[[dict[str, Any]], Any] = (
            _streamed_params if llm is None else dict)
        self.loaded: tuple | None = None  # the fingerprint of the weights vLLM holds
        self.waiting: deque[_Sample] = deque()
        self.live: dict[str, _Sample] = {}
        self.passing: list[Request] = []
        self.aborted: set[str] = set()
        self.paused = False
        self.dead: BaseException | None = None
        self.slots: list = []  # none: vLLM holds the cache (Trajectories reads it)
        self.env_calls = EnvCalls()  # trajectories' environment calls, in threads
        self.parked: dict[tuple[int, int], Any] = {}  # aborted trajectories' episodes
        self.max_len = context or 2048  # the longest sequence
        self.stats = {"steps": 0, "decode_tokens": 0, "weight_syncs": 0, "sync_seconds": 0.0,
                      "sleeps": 0, "wakes": 0}
        self._ids = 0

    # -- requests ------------------------------------------------------------------------------
    def submit(self, items: list, sampling: Sampling, n: int, *, key: str | None = None,
               agent: Agent | None = None) -> Deferred:
        """n samples of each Prompt, or the continuation of each interrupted Rollout, as one
        request; a finished Rollout passes through (the own engine's contract). With `agent`,
        each sample is a trajectory in its own environment."""
        if self.dead is not None:
            raise StageError(f"the vLLM engine here failed earlier: {self.dead}")
        modes = vllm_logprobs_mode(sampling.temperature, sampling.top_p, sampling.top_k)
        if self.logprobs_mode not in modes:
            raise StageError(
                f"this vLLM engine records {self.logprobs_mode}, which are not flowkit's "
                f"log-probs at temperature={sampling.temperature}, top_p={sampling.top_p}, "
                f"top_k={sampling.top_k}: sample the model's generate ops alike")
        request = Request(deferred=Deferred(), sampling=sampling, left=0, key=key, agent=agent)
        if key is not None and key in self.aborted:
            request.passing = [unstarted(r) for item in items
                               for r in as_rollouts(item, n, sampling)]
            request.left = len(request.passing)
            self.passing.append(request)
            return request.deferred
        for item in items:
            if isinstance(item, Rollout) and not item.interrupted:
                request.passing.append(item)
                request.left += 1
                if request not in self.passing:
                    self.passing.append(request)
                continue
            if isinstance(item, Rollout) and agent is not None:
                self._resume(request, item)  # [Note: parked trajectories] in trajectories.py
                request.left += 1
                continue
            for sample in (self._continued(request, item) if isinstance(item, Rollout)
                           else self._fresh(request, item, n)):
                request.left += 1
                if agent is None:
                    self.waiting.append(sample)
                else:
                    self._open(sample)  # its first turn once its environment is reset
        return request.deferred

    def _fresh(self, request: Request, prompt: Any, n: int) -> list[_Sample]:
        st = request.sampling
        roots = st.samples(prompt, n)  # [Note: vLLM trees]
        return [_Sample(request, prompt, root, st.seed_of(prompt.prompt_id, root),
                        limit=self._limit(len(prompt.tokens), st.max_new_tokens))
                for root in roots]

    def _sequence(self, request: Request, prompt: Any, sample: int, seed: int,
                  **fields: Any) -> _Sample:
        """A trajectory's sample (Trajectories makes them)."""
        return _Sample(request, prompt, sample, seed, **fields)

    def _continued(self, request: Request, rollout: Rollout) -> list[_Sample]:
        st = request.sampling
        prompt = self._prompt_of(rollout)
        done = len(rollout.response_tokens)
        versions = list(rollout.versions) or [NO_VERSION] * done
        return [_Sample(request, prompt, rollout.sample,
                        st.seed_of(rollout.prompt_id, rollout.sample),
                        tokens=list(rollout.response_tokens), logprobs=list(rollout.logprobs),
                        versions=versions, carried=done,
                        limit=self._limit(len(prompt.tokens), st.max_new_tokens),
                        branch_of=rollout.branch_of, shared_tokens=rollout.shared_tokens,
                        forks=st.continued_forks(done))]

    def _limit(self, prompt_length: int, max_new_tokens: int) -> int:
        if self.context is None:
            return max_new_tokens
        return max(0, min(max_new_tokens, self.context - prompt_length))

    def pause(self, paused: bool = True) -> None:
        """Stop (or restart) stepping; vLLM keeps its requests and their cache."""
        self.paused = paused

    def abort(self) -> int:
        """Every request's unfinished samples back now, `interrupted`; returns how many."""
        self._environments_answered()  # answered trajectories cut between steps: their state
        cut = distinct(list(self.live.values()) + list(self.waiting)
                    + self.env_calls.drop(lambda s: False))
        self._drop(cut)
        for sample in cut:
            self._finish(sample, finished=False, interrupted=True)
        return len(cut)

    def abort_requests(self, keys: set[str]) -> tuple[int, int]:
        """The requests named `keys` end now, their unfinished samples `interrupted`;
        returns (samples, response tokens) cut."""
        self.aborted |= keys
        self._environments_answered()
        cut = distinct([s for s in [*self.live.values(), *self.waiting] if s.request.key in keys]
                    + self.env_calls.drop(lambda s: s.request.key not in keys))
        self._drop(cut)
        for sample in cut:
            self._finish(sample, finished=False, interrupted=True)
        return len(cut), sum(len(s.tokens) - s.carried for s in cut)

    def _drop(self, samples: list[_Sample]) -> None:
        ids = [s.rid for s in samples if s.rid is not None and s.rid in self.live]
        if ids:
            self.llm.abort_request(ids)
        for rid in ids:
            del self.live[rid]
        dropped = {id(s) for s in samples}
        self.waiting = deque(s for s in self.waiting if id(s) not in dropped)

    # -- the Background ------------------------------------------------------------------------
    def busy(self) -> bool:
        return not self.paused and (bool(self.waiting) or bool(self.live) or bool(self.passing)
                                    or bool(self.env_calls))

    def step(self) -> None:
        """One vLLM iteration. A failure of vLLM fails every request it holds (they ran in one
        batch) and the engine: a later request is refused with the same error."""
        try:
            self._step()
        except Exception as error:
            self.dead = error
            failed = {id(s.request): s.request for s in [*self.live.values(), *self.waiting,
                                                         *self.env_calls.drop(lambda s: False)]}
            self.live, self.waiting = {}, deque()
            for request in failed.values():
                if not (request.deferred.finished or request.deferred.cancelled):
                    request.deferred.fail(StageError(f"the vLLM engine failed: {error}"))

    def _step(self) -> None:
        self._pass_through()
        self._drop([s for s in [*self.live.values(), *self.waiting]
                    if s.request.deferred.cancelled])
        for sample in self.env_calls.drop(lambda s: not s.request.deferred.cancelled):
            sample.episode.close()
        self._environments_answered()
        if self.asleep and self.waiting:
            self._wake()
        self.sync_weights()
        self._admit()
        if not self.live:
            if self.env_calls:  # every trajectory waits for its environment: wait, not spin
                self.env_calls.wait(_IDLE_WAIT_S)
            return
        version = self._version_now()
        for out in self.llm.step():
            sample = self.live.get(out.request_id)
            if sample is None:  # aborted meanwhile
                continue
            completion = out.outputs[0]
            new = list(completion.token_ids)
            sample.tokens += new
            sample.logprobs += _sampled_logprobs(completion.logprobs, new)
            sample.versions += [version] * len(new)
            if sample.episode is not None:
                sample.mask += [1] * len(new)  # the model's
            self.stats["decode_tokens"] += len(new)
            if out.finished:
                del self.live[out.request_id]
                stopped = completion.finish_reason == "stop"
                if sample.episode is None and not stopped and self._at_fork(sample):
                    self._fork(sample)
                elif sample.episode is None:
                    self._finish(sample, finished=stopped, interrupted=False)
                else:
                    self._turn_ended(sample, stopped)
        self.stats["steps"] += 1

    def _turn_ended(self, sample: _Sample, eos: bool) -> None:
        """A model turn's vLLM request ended: the trajectory goes on as the own engine's does
        after the turn's last token (Trajectories._after_agent_token)."""
        agent, ep = sample.request.agent, sample.episode
        full = len(sample.prompt.tokens) + len(sample.tokens) >= self.max_len
        turn = len(sample.tokens) - ep.turn_start
        if full:  # as the own engine: a turn that fills the context ends its trajectory
            self._close(sample, finished=False, clipped=True)
        elif eos or turn >= sample.request.sampling.max_new_tokens:
            action = agent.turns.text(sample.tokens[ep.turn_start:len(sample.tokens) - int(eos)])
            if not eos:
                self._append_context(sample, agent.turns.closing())
            if agent.asynchronous:
                self._begin(sample, ep.env.step_async, action)
            else:
                self.env_calls.start(sample, step_episode, ep.env, action,
                                     timeout_s=agent.timeout_s)
        else:  # its total budget (max_total_tokens) ended the turn
            self._close(sample, finished=False)

    def _admit(self) -> None:
        """Hand vLLM every waiting sample: its scheduler batches them (max_num_seqs at once).
        A sample with no room left in the context ends here, clipped."""
        while self.waiting:
            sample = self.waiting.popleft()
            room = self._room(sample)
            if room <= 0 and sample.episode is not None:
                self._close(sample, finished=False, clipped=True)
                continue
            if room <= 0:
                self._finish(sample, finished=False, interrupted=False)
                continue
            self._ids += 1
            sample.rid = f"{self._ids}"
            # a continuation (a later turn, a carried sample) draws on from where it stands
            seed = (sample.seed + len(sample.tokens)) % (1 << 63)
            params = self.make_params(sampling_params(sample.request.sampling, seed=seed,
                                                      max_tokens=room))
            prefix = list(sample.prompt.tokens) + sample.tokens
            self.llm.add_request(sample.rid, {"prompt_token_ids": prefix}, params)
            self.live[sample.rid] = sample

    def _room(self, sample: _Sample) -> int:
        """The tokens its next vLLM request may sample: the rest of its max_new_tokens (a
        trajectory: of its turn's, and of max_total_tokens), within the context."""
        if sample.episode is None:
            depth = _next_fork(sample)  # a tree's sample asks up to its branch depth
            end = sample.limit if depth is None else min(sample.limit, depth)
            return end - len(sample.tokens)
        st, agent = sample.request.sampling, sample.request.agent
        room = [st.max_new_tokens - (len(sample.tokens) - sample.episode.turn_start),
                self.max_len - len(sample.prompt.tokens) - len(sample.tokens)]
        if agent.max_total_tokens is not None:
            room.append(agent.max_total_tokens - len(sample.tokens))
        return min(room)

    def _at_fork(self, sample: _Sample) -> bool:
        """Whether a sample whose request ended by length stands at its tree's next branch
        depth, with tokens left to draw past it [Note: vLLM trees]."""
        return len(sample.tokens) == _next_fork(sample) and len(sample.tokens) < sample.limit

    def _fork(self, sample: _Sample) -> None:
        """[Note: vLLM trees] The sample and its new branches, holding its tokens so far, go on
        as requests of their own, first in line (the prefix cache still holds the prefix)."""
        st, level, depth = sample.request.sampling, sample.forks, len(sample.tokens)
        sample.forks += 1
        sample.rid = None
        for index in reversed(level_branches(sample.sample, level, len(st.branch_at),
                                             st.branches)):
            self.waiting.appendleft(_Sample(
                sample.request, sample.prompt, index, st.seed_of(sample.prompt.prompt_id, index),
                tokens=list(sample.tokens), logprobs=list(sample.logprobs),
                versions=list(sample.versions), carried=depth, limit=sample.limit,
                branch_of=sample.sample, shared_tokens=depth, forks=sample.forks))
            sample.request.left += 1
        self.waiting.appendleft(sample)

    def sync_weights(self) -> bool:
        """Give vLLM the held weights if they changed since it last got them (see the Note);
        returns whether it did."""
        if self.asleep:  # the wake loads them
            return False
        now = weights_fingerprint(self.model, self.version())
        if now == self.loaded:
            return False
        self._load_weights(now)
        self.llm.reset_prefix_cache(reset_running_requests=True)
        return True

    def _load_weights(self, fingerprint: tuple) -> None:
        """The held weights into vLLM (a sync, or a wake's reload): counted as weight_syncs."""
        import time

        start = time.perf_counter()
        reload_weights(self.llm, named_weights(self.model))
        self.loaded = fingerprint
        self.stats["weight_syncs"] += 1
        self.stats["sync_seconds"] += time.perf_counter() - start

    def make_room(self) -> None:
        """Asked before a training op here: an idle engine hands vLLM's GPU memory back
        [Note: vLLM sleeps beside a trainer]. A failing sleep fails the engine, whose next
        request is refused with vLLM's reason, not the training op."""
        if self.asleep or not self.may_sleep or self.dead is not None or self.waiting \
                or self.live or self.passing or self.env_calls:
            return
        try:
            self.llm.sleep(level=2)  # weights and KV cache discarded
        except Exception as error:
            self.dead = error
            return
        self.asleep, self.loaded = True, None
        self.stats["sleeps"] += 1

    def _wake(self) -> None:
        """Weights back first, loaded from the held model, then the KV cache, as vLLM's RLHF
        recipe orders it; the blocks torch's allocator keeps go back to the GPU first, for vLLM
        to map its memory again."""
        free_device_memory(self.device)
        self.llm.wake_up(tags=["weights"])
        self._load_weights(weights_fingerprint(self.model, self.version()))
        self.llm.wake_up(tags=["kv_cache"])
        self.llm.reset_prefix_cache(reset_running_requests=True)
        self.asleep = False
        self.stats["wakes"] += 1

    def _version_now(self) -> int:
        version = self.version()
        return NO_VERSION if version is None else int(version)

    def _finish(self, sample: _Sample, *, finished: bool, interrupted: bool,
                clipped: bool | None = None) -> None:
        st = sample.request.sampling
        if clipped is None:
            clipped = not finished and not interrupted and len(sample.tokens) < st.max_new_tokens
        prompt, ep, saved = sample.prompt, sample.episode, None
        if ep is not None and interrupted:
            saved = self._park(sample)  # a later request may continue it
        elif ep is not None:
            ep.close()
        trajectory = {} if ep is None else {
            "env_state": saved, "response_mask": sample.mask, "turns": ep.turns,
            "env_reward": ep.reward, "env_error": ep.error,
            "env_info": {**ep.info, "env_seconds": ep.seconds},
            "prompt_messages": getattr(prompt, "messages", None)}
        rollout = Rollout(prompt_id=prompt.prompt_id, sample=sample.sample,
                          prompt_tokens=list(prompt.tokens), response_tokens=sample.tokens,
                          logprobs=sample.logprobs, versions=sample.versions, finished=finished,
                          clipped=clipped, interrupted=interrupted,
                          answer=getattr(prompt, "answer", None),
                          branch_of=sample.branch_of, shared_tokens=sample.shared_tokens,
                          **self._texts(prompt, sample.tokens), **trajectory)
        self._deliver(sample.request, rollout)


def _next_fork(sample: _Sample) -> int | None:
    """The response depth at which a tree's sample forks next; None: it forks no more (or
    branches by entropy, which vLLM cannot: refused before it gets here)."""
    return sample.request.sampling.next_fork_depth(sample.forks)


# -- weights ----------------------------------------------------------------------------------
def named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The held model's parameters by their Hugging Face names (an HFCausalLM keeps them:
    [Note: Hugging Face stages] in models/hf.py), as a checkpoint names them; a tied LM head
    once, under the embedding's name, which vLLM's loaders take for both. A layer with LoRA
    adapters (executors/torch/lora.py) gives its weight with the adapters' update merged in,
    under the layer's own name, as a merged checkpoint would."""
    adapted = {path: model.get_submodule(path) for path in adapted_layers(model)}
    for name, param in model.named_parameters():
        path = next((p for p in adapted if name.startswith(p + ".")), None)
        if path is None:
            yield name, param.detach()
        elif name == f"{path}.base_layer.weight":
            yield f"{path}.weight", _merged(adapted[path])
        elif name == f"{path}.base_layer.bias":
            yield f"{path}.bias", param.detach()
        # the adapters themselves are in the merged weight


@torch.no_grad()
def _merged(layer: torch.nn.Module) -> torch.Tensor:
    """A LoRA layer's base weight plus its adapters' update (peft's get_delta_weight of its
    active adapter, or flowkit's LoRALinear's B A × alpha / r), in the weight's dtype."""
    base = layer.base_layer.weight
    if hasattr(layer, "get_delta_weight"):  # peft's
        (adapter,) = layer.active_adapters
        delta = layer.get_delta_weight(adapter)
    else:
        delta = (layer.lora_B.weight @ layer.lora_A.weight) * layer.scaling
    return (base.to(delta.dtype) + delta).to(base.dtype)


def reload_weights(llm: Any, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Load `weights` into every worker of `llm` in place (vLLM's `reload_weights`; the engine
    core is in this process, so the tensors are handed over, not serialized)."""
    given = list(weights)

    def load(worker: Any) -> None:
        runner = getattr(worker, "model_runner", worker)
        runner.reload_weights(weights_iterator=iter(given))
        _tie_head(runner.get_model())

    llm.collective_rpc(load)


def _tie_head(model: torch.nn.Module) -> None:
    """A tied LM head made again from the embedding just loaded: vLLM 0.32's in-place reload
    loads the embedding and keeps the head's kernel form of the old weights (its loaders skip
    `lm_head` of a tied model; on a CPU the head computes through a GEMM prepared from its
    weight), so greedy tokens may still agree while every log-prob is the old weights'."""
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not getattr(config, "tie_word_embeddings", False) or head is None or embed is None:
        return
    with torch.no_grad():
        if head.weight is not embed.weight:
            head.weight.copy_(embed.weight)
        method = getattr(head, "quant_method", None)
        if method is not None:  # the head's kernel form, prepared from the new weight
            method.process_weights_after_loading(head)


def _sampled_logprobs(logprobs: Any, tokens: list[int]) -> list[float]:
    """The sampled tokens' log-probs out of vLLM's per-position {token: Logprob}."""
    if logprobs is None or len(logprobs) < len(tokens):
        raise StageError("vLLM returned no log-probs for a sampled token (logprobs=0 asks for "
                         "the sampled one's)")
    return [float(logprobs[-len(tokens) + i][token].logprob) for i, token in enumerate(tokens)]


def _streamed_params(params: dict[str, Any]) -> Any:
    """vllm.SamplingParams of `params`, each step's new tokens out as they come (DELTA)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(**params, output_kind=RequestOutputKind.DELTA)


def _start(args: dict[str, Any]) -> Any:
    """A vllm LLMEngine with its engine core in this process [Note: vLLM engine]."""
    os.environ[_MULTIPROCESSING] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a model folder: nothing is downloaded
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its start, not each step, in logs
    try:
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine
    except ImportError as exc:
        from flowkit.ops.rollout_engines import VLLM_INSTALL

        raise StageError(f"--rollout-engine vllm: vllm cannot be imported here ({exc}); "
                         f"{VLLM_INSTALL}") from None
    try:
        return LLMEngine.from_engine_args(EngineArgs(**args))
    except Exception as exc:  # vLLM's own reason, on one line
        reason = next((line for line in str(exc).splitlines() if line.strip()), "")
        raise StageError(f"the vLLM engine of {args['model']!r} did not start: "
                         f"{type(exc).__name__}: {reason}") from exc
