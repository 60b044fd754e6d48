"""Bounded local search over per-device op orders: small moves, kept only when they help.

A move changes one device's order: swap two adjacent ops, or move one op (most often a W, whose
place is the freest choice in a zero-bubble schedule) a few steps earlier or later. A move is kept
only if that device stays within the memory cap and `evaluate` scores the result strictly better
(`Score.better_than`: makespan, then longest span), so the search never returns anything worse
than it was given. Moves that deadlock score None and are dropped.

The search is bounded by a number of evaluations (deterministic for a given seed) and by wall
time (a guard for very large pipelines, where one evaluation costs tens of milliseconds).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence

from flowkit.planner.schedules.greedy import Op, Problem, Score, W, evaluate, peak_memory

__all__ = ["default_budget", "improve"]

# Evaluations cost about one microsecond per op; this many op-visits keeps a search under a
# fraction of a second for the pipelines tests build, and it scales down for large ones.
_OP_VISITS = 150_000
_MAX_EVALS = 300


def default_budget(problem: Problem) -> int:
    ops = 3 * problem.stages * problem.microbatches
    return max(10, min(_MAX_EVALS, _OP_VISITS // ops))


def _move(rng: random.Random, ops: list[Op]) -> list[Op] | None:
    """A neighbour of one device's order, or None for a pointless draw."""
    n = len(ops)
    if n < 2:
        return None
    choice = rng.random()
    new = list(ops)
    if choice < 0.4:
        i = rng.randrange(n - 1)
        a, b = new[i], new[i + 1]
        if a[1] == b[1] and (a[0] == b[0] or a[2] == b[2]):
            return None  # same stage: breaks FIFO or a dependency, never helps
        new[i], new[i + 1] = b, a
        return new
    ws = [i for i, op in enumerate(ops) if op[0] == W] if choice < 0.8 else list(range(n))
    if not ws:
        return None
    i = rng.choice(ws)
    j = min(n - 1, max(0, i + rng.choice((-3, -2, -1, 1, 2, 3))))
    if i == j:
        return None
    new.insert(j, new.pop(i))
    return new


def improve(problem: Problem, orders: Sequence[Sequence[Op]], *, cap: float, evals: int,
            seconds: float = 2.0, seed: int = 0,
            span_bound: float = math.inf) -> tuple[list[list[Op]], Score]:
    """Return orders at least as good as `orders` (which must be valid, within `cap` and within
    `span_bound`); every accepted move keeps the longest span within `span_bound` too."""
    best = [list(ops) for ops in orders]
    score = evaluate(problem, best)
    if score is None:
        raise ValueError("local search needs a schedule that runs")
    rng = random.Random(seed)
    stop = time.perf_counter() + seconds
    devices = len(best)
    for _ in range(evals):
        if time.perf_counter() > stop:
            break
        d = rng.randrange(devices)
        new = _move(rng, best[d])
        if new is None or peak_memory(problem, new) > cap + 1e-9:
            continue
        old, best[d] = best[d], new
        candidate = evaluate(problem, best)
        if candidate is not None and candidate.span <= span_bound and candidate.better_than(score):
            score = candidate
        else:
            best[d] = old
    return best, score
