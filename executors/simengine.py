"""The simulator's rollout engine: a timed model of continuous batching, so that what runs on
simulator executors sees the rollout side a real engine (vLLM, SGLang, executors/torch/engine.py)
gives it.

[Note: simulated rollout engine] Requests (n samples of one prompt, their lengths already
drawn) join the running batch whenever they arrive. One `step()` is one decode iteration:
  - up to `max_batch` sequences hold a slot; free slots go to waiting samples in arrival order,
    and a request's samples share its prompt's prefill (done once, as with a prefix cache);
  - a per-iteration `token_budget`: every decoding sequence takes one token of it first, then
    chunks of admitted prompts' prefill take the rest (Sarathi-Serve's chunked prefill), so a
    long prompt never stalls decoding; the chunk that ends a prompt's prefill also yields its
    samples' first token;
  - the iteration costs `token + per_seq * b` for b sequences that produce a token, plus
    `prefill_token` per prompt token prefilled;
  - a sample whose last token was produced leaves at once (streamed when its task streams), and
    its slot goes to a waiting sample in the next iteration.
A sample of length L is thus in the batch for exactly L iterations once its prompt is
prefilled, whatever else is in the batch: the samples themselves are drawn before they join
(executors/sim.py), so batch composition changes when they come out, never what they are.

Time is kept against a running deadline rather than by sleeping each iteration's cost anew:
the oversleep of one iteration is taken off the next (up to _CATCH_UP_S), as a GPU's queue
runs ahead of the host, so a thousand-iteration decode does not drift by a thousand wake-ups.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs

from executors.ops import Deferred

__all__ = ["EngineCosts", "SimEngine", "engine_of"]

_CATCH_UP_S = 0.005  # a host stall longer than this is real lost time, not oversleep


@attrs.frozen(kw_only=True)
class EngineCosts:
    """What one iteration costs (see SimCosts in flowkit/planner/simcosts.py)."""

    token: float = 0.0  # seconds: an iteration's fixed part (the weights' read)
    per_seq: float = 0.0  # seconds per sequence producing a token (its KV cache's read)
    prefill_token: float = 0.0  # seconds per prompt token prefilled
    token_budget: int = 2048
    max_batch: int = 256

    def iteration_s(self, batch: int, prefilled: int = 0) -> float:
        return self.token + self.per_seq * batch + self.prefill_token * prefilled


@attrs.define(eq=False)
class _Request:
    deferred: Deferred
    items: list  # the samples, in sample order
    lengths: list[int]  # tokens each sample decodes (>= 1)
    prefill_left: int  # prompt tokens not prefilled yet
    stream: bool  # emit each sample as it finishes [Note: streaming ops]
    admitted: int = 0  # samples given a slot so far (in sample order)
    finished: list = attrs.field(factory=list)  # in finishing order: the task's result

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.items)


@attrs.define(eq=False)
class _Sequence:
    request: _Request
    sample: int
    produced: int = 0


class SimEngine:
    """A Background [Note: deferred ops in executors/ops.py] serving a simulator executor's
    generate requests [Note: simulated rollout engine]. `clock` and `sleep` are the timer's,
    replaceable so tests can run it on a fake clock."""

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.clock, self.sleep = clock, sleep
        self.costs = EngineCosts()
        self.requests: list[_Request] = []  # unfinished, in arrival order
        self.slots: list[_Sequence] = []
        self.deadline: float | None = None  # None: idle, the next iteration starts now
        self.iterations = 0

    def submit(self, items: list, lengths: list[int], *, prompt_tokens: int,
               costs: EngineCosts, stream: bool) -> Deferred:
        """A request: `items` come out one by one, item i after `lengths[i]` iterations in
        the batch. The latest request's costs are the engine's (a run has one set)."""
        deferred = Deferred()
        self.costs = costs
        self.requests.append(_Request(deferred, list(items), [max(1, int(n)) for n in lengths],
                                      max(0, int(prompt_tokens)), stream))
        return deferred

    def busy(self) -> bool:
        return bool(self.requests)

    def step(self) -> None:
        self._drop_cancelled()
        self._admit()
        producing, prefilled = self._schedule()
        self._wait(self.costs.iteration_s(len(producing), prefilled))
        self.iterations += 1
        for sequence in producing:
            sequence.produced += 1
            if sequence.produced == sequence.request.lengths[sequence.sample]:
                self._finish(sequence)
        if not self.requests:
            self.deadline = None

    # -- one iteration -------------------------------------------------------------------------
    def _drop_cancelled(self) -> None:
        cancelled = [r for r in self.requests if r.deferred.cancelled]
        if cancelled:
            self.requests = [r for r in self.requests if not r.deferred.cancelled]
            self.slots = [s for s in self.slots if not s.request.deferred.cancelled]

    def _admit(self) -> None:
        """Free slots to waiting samples, oldest request first."""
        free = self.costs.max_batch - len(self.slots)
        for request in self.requests:
            while free > 0 and request.admitted < len(request.items):
                self.slots.append(_Sequence(request, request.admitted))
                request.admitted += 1
                free -= 1
            if free <= 0:
                return

    def _schedule(self) -> tuple[list[_Sequence], int]:
        """The sequences that produce a token this iteration, and the prompt tokens prefilled:
        decodes take the budget first, prefill chunks what is left, oldest prompt first."""
        producing = [s for s in self.slots if s.request.prefill_left == 0]
        budget = max(0, self.costs.token_budget - len(producing))
        prefilled = 0
        for request in self.requests:
            if budget == 0:
                break
            if request.prefill_left == 0 or request.admitted == 0:
                continue
            chunk = min(budget, request.prefill_left)
            request.prefill_left -= chunk
            budget -= chunk
            prefilled += chunk
            if request.prefill_left == 0:  # the last chunk's logits give the first tokens
                producing += [s for s in self.slots if s.request is request]
        return producing, prefilled

    def _wait(self, cost: float) -> None:
        now = self.clock()
        start = now if self.deadline is None else max(self.deadline, now - _CATCH_UP_S)
        self.deadline = start + cost
        if self.deadline > now:
            self.sleep(self.deadline - now)

    def _finish(self, sequence: _Sequence) -> None:
        request = sequence.request
        self.slots.remove(sequence)
        item = request.items[sequence.sample]
        request.finished.append(item)
        if request.stream:
            request.deferred.emit(item)
        if request.done:
            self.requests.remove(request)
            request.deferred.done(list(request.finished))


def engine_of(background: dict[str, Any], name: str = "generate") -> SimEngine:
    """The executor's engine, started by its first request."""
    engine = background.get(name)
    if engine is None:
        engine = background[name] = SimEngine()
    return engine
