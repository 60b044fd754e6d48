"""V-shape schedules: two model chunks per device, device d holding stages d and 2p-1-d.

The design: [Note: vshape] below.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from flowkit.planner.ir import Placement, Schedule
from flowkit.planner.schedules.greedy import (
    B,
    F,
    Op,
    Problem,
    Rule,
    Score,
    W,
    evaluate,
    list_schedule,
    peak_memory,
    to_schedule,
    unfit_reason,
)
from flowkit.planner.schedules.local_search import default_budget, improve
from flowkit.planner.schedules.registry import ScheduleRequest, register
from flowkit.planner.schedules.vfill import fill_v_orders
from flowkit.planner.simulate import ScheduleError

__all__ = ["best_v_orders", "fill_candidates", "pattern_orders", "v_half", "v_half_slots",
           "v_min", "v_min_slots", "v_problem", "zb_v", "zbv_order"]


# [Note: vshape] The forward pass runs down the devices and back up (0 -> p-1 on chunk 0, p-1 -> 0
# on chunk 1), so device 0 holds both the first and the last stage and the hand-over at device p-1
# costs no comm.
#
# * `zb-v`: the Zero Bubble paper's ZB-V, memory p (one device share of p microbatches), about zero
#   bubble when F = B = W and m >= 2p-1.
# * `v-half`, `v-min`: "Pipeline Parallelism with Controllable Memory" (Qi et al.), memory about
#   (p+2)/2 and (p+4)/3 with bubbles of about p/2m and 2p/3m per iteration.
#
# Each builder takes the best (simulated makespan, then span) of candidates within its memory cap
# (in microbatch footprints, MemoryModel.F, lowered by a tighter `memory_limit`): the fixed
# literature order (PyTorch's ScheduleZBVZeroBubble; sail-sg's V-Half/V-Min patterns), good when
# F = B = W; the bubble-filling V ([Note: bubble-filling V] in vfill.py), for uneven costs and
# comm at memory p; and `list_schedule` under the cap, for any m; local search then polishes it.

Orders = list[list[Op]]
# (b_hold, w_fill) of the list-scheduling rules tried under each cap.
RULES = tuple((h, f) for h in (False, True) for f in ("fit", "eager"))


def v_problem(request: ScheduleRequest) -> Problem:
    placement = Placement.vshape(request.devices)
    return Problem(placement=placement, costs=request.costs.for_placement(placement),
                   memory=request.memory, microbatches=request.microbatches)


def zbv_order(p: int, m: int) -> Orders:
    """PyTorch's ScheduleZBVZeroBubble order (zero bubble at F = B = W, m >= 2p-1, memory p).

    It is written for n = max(m, 2p-1) microbatches; ops of the fake ones are dropped."""
    n, out = max(2 * p - 1, m), []
    for r in range(p):
        c0, c1 = r, 2 * p - 1 - r
        o: list[Op] = []
        cnt = {(F, c0): 0, (F, c1): 0, (B, c0): 0, (B, c1): 0}

        def emit(kind: int, s: int, w: int | None = None, o=o, cnt=cnt) -> None:
            if kind == W:
                o.append((W, s, w))
                return
            o.append((kind, s, cnt[(kind, s)]))
            cnt[(kind, s)] += 1

        for _ in range(2 * (p - r) - 1):
            emit(F, c0)
        for _ in range(r):
            emit(F, c1), emit(F, c0)
        for _ in range(p - r):
            emit(F, c1), emit(B, c1), emit(W, c1, cnt[(B, c1)] - 1)
        while cnt[(F, c1)] < cnt[(F, c0)] or cnt[(F, c0)] < n:
            if cnt[(F, c0)] < n:
                emit(F, c0)
            emit(B, c0), emit(W, c0, cnt[(B, c0)] - 1)
            emit(F, c1), emit(B, c1), emit(W, c1, cnt[(B, c1)] - 1)
        w0, w1 = cnt[(B, c0)], cnt[(B, c1)]
        for _ in range(r):
            emit(B, c0), emit(B, c1)
        for _ in range(p - r):
            emit(B, c0), emit(W, c0, w0)
            w0 += 1
        o += [(W, c1, k) for k in range(w1, cnt[(B, c1)])]
        o += [(W, c0, k) for k in range(w0, cnt[(B, c0)])]
        out.append([op for op in o if op[2] < m])
    return out


def v_min_slots(p: int, i: int) -> list[int]:
    iv = 2 if p % 3 == 0 else 0  # keeps a device's four slots distinct mod 6
    return [i, 2 * p - 1 - i, 2 * p + iv + i, 4 * p + iv - 1 - i]


def v_half_slots(p: int, i: int) -> list[int]:
    iv = 3 if p % 2 == 0 else 0
    return [2 * i, 3 * p - 2 - i, 3 * p + iv + 2 * i - 1, 6 * p + iv - 2 - i]


def pattern_orders(slots: Callable[[int, int], list[int]], p: int, m: int) -> Orders:
    """sail-sg's building-block schedule: microbatch k's F chunk 0, F chunk 1, B chunk 1 and B
    chunk 0 on device i sit at slots(p, i) + 6k; W's (oldest first) fill the free slots."""
    out = []
    for i in range(p):
        stage = (i, 2 * p - 1 - i, 2 * p - 1 - i, i)
        events = sorted(
            (slot + 6 * k, kind, k) for kind, slot in enumerate(slots(p, i)) for k in range(m))
        ops: list[Op] = []
        pending: list[tuple[int, int]] = []
        t, e = 0, 0
        while e < len(events) or pending:
            if e < len(events) and events[e][0] == t:
                _, kind, k = events[e]
                ops.append((F if kind < 2 else B, stage[kind], k))
                if kind >= 2:
                    pending.append((stage[kind], k))
                e += 1
            elif pending:
                s, k = pending.pop(0)
                ops.append((W, s, k))
            t += 1
        out.append(ops)
    return out


def fill_candidates(problem: Problem, cap: float) -> list[Orders | None]:
    """The bubble-filling V's four variants within `cap` (None where one does not fit)."""
    return [fill_v_orders(problem, cap, fill_f=f, fill_b=b) for f in (True, False)
            for b in (True, False)]


def best_v_orders(problem: Problem, cap: float, fixed: Iterable[Orders] = (), *,
                  evals: int | None = None) -> tuple[Orders, Score]:
    """The candidate of the shortest longest span within `cap` (the paper's bubble rate), then
    polished by local search, which keeps that span; ScheduleError if none fits."""
    reason = unfit_reason(problem, cap)
    if reason is not None:
        raise ScheduleError(f"no V schedule fits memory cap {cap:g}: {reason}", over_memory=True)
    candidates = list(fixed) + fill_candidates(problem, cap) + [
        list_schedule(problem, Rule(cap=cap, b_hold=h, w_fill=f)) for h, f in RULES]
    best: tuple[Orders, Score] | None = None
    for orders in candidates:
        if orders is None or max(peak_memory(problem, o) for o in orders) > cap + 1e-9:
            continue
        score = evaluate(problem, orders)
        if score is not None and _shorter_span(score, best[1] if best else None):
            best = (orders, score)
    if best is None:  # unreachable past unfit_reason [Note: memory reservation]
        raise ScheduleError(f"no V schedule found within memory cap {cap:g}", over_memory=True)
    budget = default_budget(problem) if evals is None else evals
    return improve(problem, best[0], cap=cap, evals=budget, span_bound=best[1].span)


def _shorter_span(score: Score, other: Score | None) -> bool:
    """The paper's objective first: the longest device span (its bubble rate), then the
    makespan. The local search after it may shorten the makespan, never lengthen the span."""
    if other is None:
        return True
    tol = 1e-9 * max(1.0, other.span)
    if abs(score.span - other.span) > tol:
        return score.span < other.span
    return score.better_than(other)


def _build(request: ScheduleRequest, share: float, fixed: Callable[[int, int], Orders]) -> Schedule:
    problem = v_problem(request)
    p, m = request.devices, request.microbatches
    cap = min(p, share) * problem.footprint
    if request.memory_limit is not None:
        cap = min(cap, request.memory_limit)
    orders, _ = best_v_orders(problem, cap, [fixed(p, m)])
    return to_schedule(request.kind, problem, orders)


@register("zb-v", chunks=(2,))
def zb_v(request: ScheduleRequest) -> Schedule:
    """ZB-V: two chunks per device in a V, memory p, about zero bubble when F = B = W."""
    return _build(request, request.devices, zbv_order)


@register("v-half", chunks=(2,))
def v_half(request: ScheduleRequest) -> Schedule:
    """V-Half: V shape with about half of 1F1B's memory ((p+2)/2), small bubble."""
    p = request.devices
    return _build(request, (p + 2) / 2, lambda p, m: pattern_orders(v_half_slots, p, m))


@register("v-min", chunks=(2,))
def v_min(request: ScheduleRequest) -> Schedule:
    """V-Min: V shape with about a third of 1F1B's memory ((p+4)/3), 1F1B-like bubble."""
    p = request.devices
    return _build(request, (p + 4) / 3, lambda p, m: pattern_orders(v_min_slots, p, m))
