"""The simulator's rollout engine: a timed model of continuous batching, so that what runs on
simulator executors sees the rollout side a real engine (vLLM, SGLang,
executors/torch/rollout/engine.py) gives it.

The design: [Note: simulated rollout engine] below.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from typing import Any

import attrs

from executors.optable import Deferred
from flowkit.ops.records import Rollout

__all__ = ["EngineCosts", "SimEngine", "engine_of"]


# [Note: simulated rollout engine] Requests (n samples of one prompt, their lengths already drawn)
# join the running batch whenever they arrive. One `step()` is one decode iteration: up to
# `max_batch` sequences hold a slot, given in arrival order, and a request's samples share one
# prefill; a `token_budget` goes to one token per decoding sequence first, then chunks of prefill
# (Sarathi-Serve), the chunk ending a prefill also yielding the first tokens; the iteration costs
# `token + per_seq * b` plus `prefill_token` per prompt token prefilled; a finished sample leaves
# at once. Why: a sample of length L stays exactly L iterations after its prefill whatever else
# is in the batch, since samples are drawn before they join (executors/sim/ops.py). Time is kept
# against a running deadline, one iteration's oversleep taken off the next (up to _CATCH_UP_S),
# so a long decode does not drift by a wake-up per iteration. In full: docs/running-flows.md,
# "On the simulator".

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
    key: str | None = None  # its name, to abort it alone
    admitted: int = 0  # samples given a slot so far (in sample order)
    waiting: list[int] = attrs.field(factory=list)  # admitted, until the prefill ends
    live: int = 0  # samples decoding
    finished: list = attrs.field(factory=list)  # in finishing order: the task's result

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.items)


class SimEngine:
    """A Background [Note: deferred ops in executors/optable.py] serving a simulator executor's
    generate requests [Note: simulated rollout engine]. `clock` and `sleep` are the timer's,
    replaceable so tests can run it on a fake clock.

    A sample's last iteration is known when it starts decoding (it produces a token every
    iteration), so an iteration touches only the samples that finish in it: a heap by last
    iteration. Python work per iteration then stays far below the iteration's simulated cost
    at any batch, and so does not slow the simulated engine down."""

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.clock, self.sleep = clock, sleep
        self.costs = EngineCosts()
        self.requests: list[_Request] = []  # unfinished, in arrival order
        self.slots = 0  # sequences holding a slot: decoding, or waiting for their prefill
        self.live = 0  # sequences decoding
        self.ending: list[tuple[int, int, _Request, int]] = []  # (last iteration, tie, r, sample)
        self.deadline: float | None = None  # None: idle, the next iteration starts now
        self.iterations = 0
        self.paused = False
        self.aborted: set[str] = set()  # request keys aborted, also before they arrived

    def submit(self, items: list, lengths: list[int], *, prompt_tokens: int,
               costs: EngineCosts, stream: bool, key: str | None = None) -> Deferred:
        """A request: `items` come out one by one, item i after `lengths[i]` iterations in
        the batch (0: at once, a finished sample carried over). The latest request's costs
        are the engine's (a run has one set)."""
        deferred = Deferred()
        self.costs = costs
        lengths = [max(0, int(n)) for n in lengths]
        if key is not None and key in self.aborted:  # its abort came first: it ends at once
            items = [_interrupted(item, _base(item, n)) if n else item
                     for item, n in zip(items, lengths)]
            lengths = [0] * len(items)
        self.requests.append(_Request(deferred, list(items), lengths,
                                      max(0, int(prompt_tokens)), stream, key))
        return deferred

    def busy(self) -> bool:
        return bool(self.requests) and not self.paused

    def pause(self, paused: bool = True) -> None:
        """Stop (or restart) decoding; the requests keep their place."""
        self.paused = paused
        self.deadline = None  # a resumed engine starts its next iteration then, not before

    def abort(self, keys: set[str] | None = None) -> tuple[int, int]:
        """Every request (or those named `keys`) ended now: each unfinished sample comes back
        cut at the tokens it has decoded, `interrupted` (as the torch engine's abort); returns
        (samples, tokens) cut."""
        decoded = {(id(r), sample): self.iterations - (last - r.lengths[sample] + 1)
                   for last, _, r, sample in self.ending}
        self.aborted |= keys or set()  # a request still on its way ends as it arrives
        ending = [r for r in self.requests if keys is None or r.key in keys]
        cut = tokens = 0
        for request in ending:
            done = {id(item) for item in request.finished}
            for sample, item in enumerate(request.items):
                if id(item) not in done:
                    made = decoded.get((id(request), sample), 0)
                    # a continued sample's item is the whole of it: keep what it came with
                    base = _base(item, request.lengths[sample])
                    request.finished.append(_interrupted(item, base + made))
                    cut, tokens = cut + 1, tokens + made
                    if request.stream:
                        request.deferred.emit(request.finished[-1])
            request.deferred.done(list(request.finished))
            self.requests.remove(request)
            self.slots -= request.live + len(request.waiting)
            self.live -= request.live
        gone = {id(r) for r in ending}
        self.ending = [e for e in self.ending if id(e[2]) not in gone]
        heapq.heapify(self.ending)
        if not self.requests:
            self.deadline = None
        return cut, tokens

    def step(self) -> None:
        self._drop_cancelled()
        self._admit()
        prefilled = self._prefill()
        self._wait(self.costs.iteration_s(self.live, prefilled))
        now, ending = self.iterations, self.ending
        while ending and ending[0][0] == now:
            _, _, request, sample = heapq.heappop(ending)
            if not request.deferred.cancelled:
                self._finish(request, sample)
        self.iterations += 1
        if not self.requests:
            self.deadline = None

    # -- one iteration -------------------------------------------------------------------------
    def _drop_cancelled(self) -> None:
        for request in [r for r in self.requests if r.deferred.cancelled]:
            self.requests.remove(request)
            self.slots -= request.live + len(request.waiting)
            self.live -= request.live  # its entries in `ending` are skipped when due

    def _admit(self) -> None:
        """Free slots to waiting samples, oldest request first; a request's samples start at
        once when its prompt is prefilled already."""
        free = self.costs.max_batch - self.slots
        for request in list(self.requests):  # a carried, finished sample may end one here
            if free <= 0:
                return
            take = min(free, len(request.items) - request.admitted)
            samples = range(request.admitted, request.admitted + take)
            request.admitted += take
            free -= take
            self.slots += take
            if request.prefill_left == 0:
                self._start(request, samples)
            else:
                request.waiting.extend(samples)

    def _prefill(self) -> int:
        """Prompt tokens prefilled this iteration: what the decodes leave of the budget, oldest
        prompt first; a prompt whose prefill ends starts its admitted samples (the last
        chunk's logits give their first token)."""
        budget = max(0, self.costs.token_budget - self.live)
        prefilled = 0
        for request in list(self.requests):
            if budget == 0:
                break
            if not request.waiting or request.prefill_left == 0:
                continue
            chunk = min(budget, request.prefill_left)
            request.prefill_left -= chunk
            budget -= chunk
            prefilled += chunk
            if request.prefill_left == 0:
                self._start(request, request.waiting)
                request.waiting = []
        return prefilled

    def _start(self, request: _Request, samples: Any) -> None:
        """Samples that produce their first token this iteration (one with nothing to decode
        leaves at once)."""
        for sample in samples:
            if request.lengths[sample] == 0:
                request.live += 1
                self.live += 1
                self._finish(request, sample)
                continue
            last = self.iterations + request.lengths[sample] - 1
            heapq.heappush(self.ending, (last, next(_TIES), request, sample))
            request.live += 1
            self.live += 1

    def _wait(self, cost: float) -> None:
        now = self.clock()
        start = now if self.deadline is None else max(self.deadline, now - _CATCH_UP_S)
        self.deadline = start + cost
        if self.deadline > now:
            self.sleep(self.deadline - now)

    def _finish(self, request: _Request, sample: int) -> None:
        request.live -= 1
        self.live -= 1
        self.slots -= 1
        item = request.items[sample]
        request.finished.append(item)
        if request.stream:
            request.deferred.emit(item)
        if request.done:
            self.requests.remove(request)
            request.deferred.done(list(request.finished))


def _base(item: Any, length: int) -> int:
    """The response tokens a sample came with, before the `length` it decodes here."""
    return max(0, len(item.response_tokens) - length) if isinstance(item, Rollout) else 0


def _interrupted(item: Any, tokens: int) -> Any:
    """A sample's Rollout cut after `tokens` decoded tokens (a plain item as it is)."""
    if not isinstance(item, Rollout):
        return item
    tokens = max(0, min(tokens, len(item.response_tokens)))
    return attrs.evolve(item, response_tokens=item.response_tokens[:tokens],
                        logprobs=item.logprobs[:tokens], versions=item.versions[:tokens],
                        finished=False, interrupted=True)


_TIES = itertools.count()  # heap entries that end together leave in the order they started


def engine_of(background: dict[str, Any], name: str = "generate") -> SimEngine:
    """The executor's engine, started by its first request."""
    engine = background.get(name)
    if engine is None:
        engine = background[name] = SimEngine()
    return engine
