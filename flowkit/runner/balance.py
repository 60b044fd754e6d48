"""Length-aware dispatch: calls of an op whose work varies widely (generation, with its
long-tailed response lengths) go to the executors able to run them by predicted work.

The design: [Note: length-aware dispatch] below.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import attrs

__all__ = ["Balancer", "LengthEstimates", "rank_correlation"]


# [Note: length-aware dispatch] An op declares how to predict a call's work (a Workload in
# flowkit/dsl/operators.py: for Generate, n samples of a prompt's estimated length). Per step the
# runner estimates each call's per-item work from its key's history (an EMA across steps of the
# mean length its items reached), else from the longest of its key's items finished this step
# (the first to finish are the shortest), else the running mean of all lengths, else half the
# budget; submits the ready calls longest first (the engine admits in arrival order, so the long
# ones start first and do not become the tail); and sends each to the able executor with the
# least predicted work open, greedy longest-processing-time-first, learning each item's size as
# it finishes (a report key, nothing fetched); `generate/length_rank_corr` (Spearman) says how
# well it ranked. Lent executors (holding a training stage) take a call only while nothing else
# of theirs is outstanding, so generation never queues ahead of their training; where every able
# executor trains, none is held back. In full: docs/running-flows.md, "On the simulator".


@attrs.define
class LengthEstimates:
    """What an op's items of each key took, across steps."""

    alpha: float = 0.5  # weight of the newest step in the moving average
    ema: dict[Any, float] = attrs.field(factory=dict)
    total: float = 0.0
    count: int = 0

    def estimate(self, key: Any, *, budget: float, group: Sequence[int] = ()) -> tuple[float, bool]:
        """(predicted work per item, whether it came from the key's history)."""
        if key is not None and key in self.ema:
            return self.ema[key], True
        if group:
            return float(max(group)), False
        if self.count:
            return self.total / self.count, False
        return budget / 2, False

    def learn(self, sizes: dict[Any, list[int]]) -> None:
        """One step's sizes by key."""
        for key, values in sizes.items():
            if not values:
                continue
            mean = statistics.fmean(values)
            old = self.ema.get(key)
            self.ema[key] = mean if old is None or key is None else (
                self.alpha * mean + (1 - self.alpha) * old)
            self.total += sum(values)
            self.count += len(values)
        self.ema.pop(None, None)  # items without a key share no history


@attrs.define(eq=False)
class _Call:
    executor: int
    key: Any
    count: int
    per_item: float  # predicted when it was sent
    history: bool
    sizes: list[int] = attrs.field(factory=list)  # of its items finished so far
    open: bool = True
    largest: float = 0.0  # per_item, raised to the largest size finished

    def remaining(self) -> float:
        if not self.open:
            return 0.0
        return max(0, self.count - len(self.sizes)) * max(self.largest, self.per_item, 0)


class Balancer:
    """One step's dispatch of one op's calls over `executors` (ids) [Note: length-aware
    dispatch]; `count` items per call, each of at most `budget` work."""

    def __init__(self, estimates: LengthEstimates, executors: Sequence[int], *, count: int,
                 budget: float, lent: frozenset[int] = frozenset(),
                 outstanding: Callable[[int], int] | None = None) -> None:
        if not executors:
            raise ValueError("no executor to balance over")
        self.estimates, self.executors = estimates, list(executors)
        # lent executors and their tasks outstanding: they take calls only when idle
        self.lent = lent if outstanding is not None else frozenset()
        self.outstanding = outstanding
        self.dedicated = [e for e in self.executors if e not in self.lent]
        self.count, self.budget = max(1, int(count)), float(budget)
        self.calls: dict[tuple, _Call] = {}
        self.sizes: dict[Any, list[int]] = defaultdict(list)  # this step's, by key
        # per executor: the predicted work its open calls have left, and how many are open;
        # kept up to date call by call, so an assignment never walks the step's calls
        self.load = dict.fromkeys(self.executors, 0.0)
        self.open_calls = dict.fromkeys(self.executors, 0)

    def predicted(self, key: Any) -> tuple[float, bool]:
        return self.estimates.estimate(key, budget=self.budget, group=self.sizes.get(key, ()))

    def order(self, ready: Sequence[tuple[tuple, Any]]) -> list[tuple[tuple, Any]]:
        """(lineage, key) pairs longest first; ties keep their order."""
        return sorted(ready, key=lambda call: -self.predicted(call[1])[0])

    def assign(self, lineage: tuple, key: Any) -> int:
        """The executor for a call: the least predicted work open, then the fewest calls."""
        load, calls = self.load, self.open_calls
        executor = min(self._candidates(), key=lambda e: (load[e], calls[e]))
        per_item, history = self.predicted(key)
        call = self.calls[lineage] = _Call(executor, key, self.count, per_item, history)
        load[executor] += call.remaining()
        calls[executor] += 1
        return executor

    def _candidates(self) -> list[int]:
        """The executors a call may go to: a lent one only with nothing but this node's calls
        outstanding [Note: length-aware dispatch]."""
        if not self.lent or not self.dedicated:
            return self.executors
        idle = [e for e in self.lent if self.outstanding(e) <= self.open_calls[e]]
        return self.dedicated + idle

    def finished(self, lineage: tuple, size: Any) -> None:
        """An item of the call at `lineage` is done, its size reported (None: unknown)."""
        call = self.calls.get(lineage)
        if call is None or not isinstance(size, (int, float)):
            return
        before = call.remaining()
        call.sizes.append(int(size))
        call.largest = max(call.largest, int(size))
        self.sizes[call.key].append(int(size))
        self.load[call.executor] += call.remaining() - before

    def closed(self, lineage: tuple) -> None:
        call = self.calls.get(lineage)
        if call is not None and call.open:
            self.load[call.executor] -= call.remaining()
            self.open_calls[call.executor] -= 1
            call.open = False

    def end_step(self, prefix: str) -> dict[str, float]:
        """Teach the estimates this step's sizes; the step's dispatch metrics."""
        self.estimates.learn(self.sizes)
        predicted, actual = [], []
        for call in self.calls.values():
            if call.history:
                predicted += [call.per_item] * len(call.sizes)
                actual += call.sizes
        metrics = {}
        correlation = rank_correlation(predicted, actual)
        if correlation is not None:
            metrics[f"{prefix}/length_rank_corr"] = correlation
        work = dict.fromkeys(self.executors, 0)
        for call in self.calls.values():
            work[call.executor] += sum(call.sizes)
        if sum(work.values()):  # the busiest executor's share over the mean: 1 is even
            metrics[f"{prefix}/work_imbalance"] = max(work.values()) / statistics.fmean(
                work.values())
        return metrics


def rank_correlation(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation (tied values share their mean rank); None when it is not
    defined: fewer than two pairs, or either side all equal."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} predictions for {len(ys)} values")
    if len(xs) < 2:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return None
    return sxy / (sxx * syy) ** 0.5


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks
