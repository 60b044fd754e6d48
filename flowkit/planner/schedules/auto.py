"""`auto`: the shortest schedule we can find for the given costs, comm and memory limit.

The design: [Note: auto], [Note: auto objective] below.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import attrs

from flowkit.planner.ir import Placement, Schedule
from flowkit.planner.schedules import handcrafted, vshape
from flowkit.planner.schedules.greedy import (
    Op,
    Problem,
    Rule,
    Score,
    evaluate,
    from_schedule,
    list_schedule,
    peak_memory,
    to_schedule,
    unfit_reason,
)
from flowkit.planner.schedules.local_search import default_budget, improve
from flowkit.planner.schedules.registry import ScheduleRequest, register
from flowkit.planner.schedules.zb_heuristic import zb_heuristic
from flowkit.planner.simulate import ScheduleError

__all__ = ["auto", "auto_orders"]


# [Note: auto] It simulates a pool of candidates and keeps the best by makespan, then by longest
# device span (the paper's per-iteration cost, so also the bubble rate), then polishes the winner
# with a bounded local search that only accepts strict improvements. Because the pool always holds
# the Zero Bubble paper's own automatic schedule (the port in `zb_heuristic`, all 8 flag
# combinations, at the requested limit) and the handcrafted 1F1B, ZB-H1 and ZB-H2 whenever they fit,
# the result is never worse than any of them. The pool (one stage per device):
#
# * the paper's heuristic at the limit, and at p, 2p-1 and 2p when those are tighter (a tighter cap
#   sometimes schedules better: it forces W's into the holes that extra F's would leave);
# * `list_schedule` under the same caps with each of its tie-breaking rules, which adapts to uneven
#   stage costs (a last stage carrying the LM head) where the wave-based heuristic does not;
# * 1F1B, ZB-H1, ZB-H2, when they fit.
#
# [Note: auto objective] The objective is makespan, then span, then peak memory (so that a tie, as
# with zero costs, does not spend memory for nothing), after two constraints: no later finish than
# any baseline (heuristic, 1F1B, ZB-H1, ZB-H2), then, where some candidate allows it, no longer span
# than the heuristic's. The two measures can disagree: on the paper's 1.5B p=8 m=24 row at memory 2p
# a list schedule ends 0.1 earlier than the heuristic (1236.5 vs 1236.6) but leaves a stage idle
# early on, which the heuristic's post-validation runtime overlaps with the previous iteration; its
# span-based bubble is .0743 against the heuristic's .0433. With the constraints auto never finishes
# later than a baseline and is never worse than the heuristic on both measures at once; when no
# candidate beats both the heuristic's span and a baseline's finish (a baseline finishing first with
# a longer span), the finish wins.
#
# With ``chunks=2`` it searches V-shape placements instead: ZB-V's fixed order, the V-Half/V-Min
# patterns, and `list_schedule` under the limit and under p, (p+2)/2 and (p+4)/3.

Orders = list[list[Op]]
Scored = tuple[Orders, Score]
_SEARCH_SECONDS = 1.0
_LARGE = 4096  # stages x microbatches


def _caps(limit: float, shares: Iterable[float], footprint: float) -> list[float]:
    """`limit` and every tighter share of p that still holds one microbatch, largest first."""
    caps = {limit} | {s * footprint for s in shares if footprint <= s * footprint < limit}
    return sorted(caps, reverse=True)


def _breadth(problem: Problem) -> int:
    """How many memory caps to try: all of them unless one list schedule takes ~0.1 s or more."""
    return 4 if problem.stages * problem.microbatches <= _LARGE else 1


def _greedy(problem: Problem, caps: Iterable[float]) -> Iterator[Orders | None]:
    for cap in caps:
        for b_hold, w_fill in vshape.RULES:
            yield list_schedule(problem, Rule(cap=cap, b_hold=b_hold, w_fill=w_fill))


def _baselines(request: ScheduleRequest, problem: Problem) -> list[Orders | None]:
    """What auto must never lose to: the paper's heuristic (first) and the handcrafted orders."""
    if request.chunks != 1:
        return []
    handmade = (handcrafted.one_f_one_b, handcrafted.zb_h1, handcrafted.zb_h2)
    return [zb_heuristic(problem, request.memory_limit)] + [
        from_schedule(build(request)) for build in handmade]


def _explore(request: ScheduleRequest, problem: Problem, limit: float) -> Iterator[Orders | None]:
    p, m = request.devices, request.microbatches
    if request.chunks == 1:
        caps = _caps(limit, (p, 2 * p - 1, 2 * p), problem.footprint)[: _breadth(problem)]
        for cap in caps[1:]:
            yield zb_heuristic(problem, cap)
    else:
        yield vshape.zbv_order(p, m)
        yield vshape.pattern_orders(vshape.v_half_slots, p, m)
        yield vshape.pattern_orders(vshape.v_min_slots, p, m)
        caps = _caps(limit, (p, (p + 2) / 2, (p + 4) / 3), problem.footprint)
        caps = caps[: _breadth(problem)]
        for cap in caps:
            yield from vshape.fill_candidates(problem, cap)
    yield from _greedy(problem, caps)


def _scored(problem: Problem, pool: Iterable[Orders | None], limit: float) -> list[Scored]:
    out = []
    for orders in pool:
        if orders is None:
            continue
        peak = max(peak_memory(problem, o) for o in orders)
        score = evaluate(problem, orders) if peak <= limit + 1e-9 else None
        if score is not None:  # the peak breaks time ties: no memory spent for nothing
            out.append((orders, attrs.evolve(score, peak=peak)))
    return out


def _pick(candidates: list[Scored], baselines: list[Scored], reference: bool,
          limit: float) -> Scored:
    """[Note: auto objective] First never worse than the paper's heuristic (when it ran) on both
    makespan and span, the figures it is judged by -- the heuristic itself always qualifies, so
    this always holds; among those, the least makespan, then the shortest span, then the lowest
    peak memory. A handcrafted
    schedule that finishes earlier but with a longer span than the heuristic is not taken."""
    slack = 1 + 1e-9
    heuristic = baselines[0][1] if reference else None
    h_finish = heuristic.makespan * slack if heuristic else math.inf
    h_span = heuristic.span * slack if heuristic else math.inf
    best: Scored | None = None
    best_worse = True
    for orders, score in candidates:
        worse = score.makespan > h_finish or score.span > h_span
        if best is None or worse < best_worse or (
                worse == best_worse and score.better_than(best[1])):
            best, best_worse = (orders, score), worse
    if best is None:  # unreachable past unfit_reason [Note: memory reservation]
        raise ScheduleError(f"no schedule found within memory_limit={limit:g}", over_memory=True)
    return best


def auto_orders(request: ScheduleRequest) -> tuple[Problem, Orders, Score]:
    """The best orders found for `request` and their score; ValueError if nothing fits."""
    if request.chunks == 1:
        placement = Placement.one_per_device(request.devices)
    else:
        placement = Placement.vshape(request.devices)
    problem = Problem(placement=placement, costs=request.costs.for_placement(placement),
                      memory=request.memory, microbatches=request.microbatches)
    limit = request.memory_limit if request.memory_limit is not None else problem.ceiling
    reason = unfit_reason(problem, limit)
    if reason is not None:  # an unsatisfiable request, not a usage error: exit 1, saying why
        raise ScheduleError(f"no schedule fits memory_limit={limit:g}: {reason}", over_memory=True)
    raw = _baselines(request, problem)
    baselines = _scored(problem, raw, limit)
    reference = bool(raw) and raw[0] is not None and bool(baselines) and baselines[0][0] is raw[0]
    candidates = baselines + _scored(problem, _explore(request, problem, limit), limit)
    orders, score = _pick(candidates, baselines, reference, limit)
    # The search keeps the span bound only if the pick already meets it.
    bound = baselines[0][1].span * (1 + 1e-9) if reference else math.inf
    orders, score = improve(problem, orders, cap=limit, evals=default_budget(problem),
                            seconds=_SEARCH_SECONDS,
                            span_bound=bound if score.span <= bound else math.inf)
    return problem, orders, score


@register("auto", chunks=(1, 2))
def auto(request: ScheduleRequest) -> Schedule:
    """Auto: the least-makespan schedule found by search under the memory limit."""
    problem, orders, _ = auto_orders(request)
    return to_schedule(request.kind, problem, orders)
