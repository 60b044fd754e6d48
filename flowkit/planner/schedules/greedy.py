"""Cost-aware list scheduling under a memory cap, and a fast evaluator for search.

Both work on `Problem`, a flat, index-friendly view of (placement, per-stage costs, memory model,
microbatches), and on orders: one list of ``(kind, stage, microbatch)`` integer triples per device
(kind 0 = F, 1 = B, 2 = W, 3 = BW). The public simulator (`flowkit.planner.simulate`) stays the
judge of every schedule handed out; `evaluate` only has to agree with it, faster, while searching.

[Note: memory reservation] A device holding several stages of one microbatch (the V shape holds
stages d and 2p-1-d) must be able to run that microbatch's later forwards once it has run its
first; otherwise it can fill its memory with first-chunk forwards and deadlock. So starting a new
microbatch on a device reserves the memory of all of that microbatch's forwards there. With this
reservation the oldest unfinished microbatch can always make progress, so any cap of at least one
microbatch's footprint (`Problem.footprint`) is deadlock-free.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Sequence
from itertools import accumulate

import attrs

from flowkit.planner.ir import Action, Costs, Kind, MemoryModel, Placement, Schedule

__all__ = ["F", "B", "W", "BW", "Op", "Problem", "Score", "evaluate", "list_schedule",
           "to_schedule", "unfit_reason"]

F, B, W, BW = 0, 1, 2, 3
Op = tuple[int, int, int]  # (kind, stage, microbatch)
_KINDS = (Kind.F, Kind.B, Kind.W, Kind.BW)
_EPS = 1e-9


@attrs.frozen(kw_only=True)
class Problem:
    """A placement with per-stage costs and memory deltas, ready for fast scheduling."""

    placement: Placement
    costs: Costs  # per stage of `placement`
    memory: MemoryModel
    microbatches: int

    @property
    def devices(self) -> int:
        return self.placement.num_devices

    @property
    def stages(self) -> int:
        return self.placement.num_stages

    def delta(self, kind: int) -> float:
        """Memory an op of `kind` adds on its device (a stage is 1/chunks of a device share)."""
        return self.deltas[kind]

    @functools.cached_property
    def deltas(self) -> tuple[float, ...]:  # by kind: the searches ask in inner loops
        return tuple(self.memory.delta(Action(0, kind, 0), self.placement.chunks)
                     for kind in _KINDS)

    def cost(self, kind: int, stage: int) -> float:
        c = self.costs
        return (c.F[stage], c.B[stage], c.W[stage], c.B[stage] + c.W[stage])[kind]

    @property
    def footprint(self) -> float:
        """Memory one microbatch holds on a device after all its forwards there."""
        return self.delta(F) * self.placement.chunks

    @property
    def ceiling(self) -> float:
        """The most any order can hold on a device: every addition and none of the releases."""
        add = [max(0.0, self.delta(k)) for k in (F, B, W, BW)]
        per_op = add[F] + max(add[B] + add[W], add[BW])
        return self.microbatches * self.placement.chunks * per_op


@attrs.frozen
class Score:
    makespan: float
    span: float  # the longest device span (first start to last end): the paper's cost
    peak: float = 0.0  # the highest device's peak memory, where the caller filled it in

    def better_than(self, other: Score | None) -> bool:
        """Smaller makespan, then smaller span, then lower peak memory; differences under a
        relative 1e-9 are ties. `evaluate` leaves peak at 0, so searches compare only time."""
        if other is None:
            return True
        for mine, theirs in ((self.makespan, other.makespan), (self.span, other.span),
                             (self.peak, other.peak)):
            tol = _EPS * max(1.0, abs(theirs))
            if mine < theirs - tol:
                return True
            if mine > theirs + tol:
                return False
        return False


def to_schedule(kind: str, problem: Problem, orders: Sequence[Sequence[Op]]) -> Schedule:
    return Schedule(kind=kind, placement=problem.placement, microbatches=problem.microbatches,
                    device_ops=[[Action(s, _KINDS[k], mb) for k, s, mb in ops] for ops in orders])


def from_schedule(schedule: Schedule) -> list[list[Op]]:
    return [
        [(_KINDS.index(a.kind), a.stage, a.microbatch) for a in ops] for ops in schedule.device_ops]


def peak_memory(problem: Problem, ops: Sequence[Op]) -> float:
    deltas = problem.deltas
    return max(0.0, max(accumulate(deltas[op[0]] for op in ops), default=0.0))


def unfit_reason(problem: Problem, cap: float) -> str | None:
    """Why no schedule of `problem` can keep every device within `cap`, or None if one may.

    A floor on a device's peak: when its last forward runs, that microbatch holds all of its
    forwards there (its backwards there need this forward first), and every other microbatch
    holds at least what its backwards there cannot free.
    """
    fp, m = problem.footprint, problem.microbatches
    if cap < fp - _EPS:
        return f"one microbatch alone needs {fp:g} on a device (its forwards on every stage there)"
    freed = -min(problem.delta(B) + problem.delta(W), problem.delta(BW))
    kept = fp - max(0.0, freed) * problem.placement.chunks  # per microbatch after its backwards
    need = (m - 1) * kept + fp
    if need <= cap + _EPS:
        return None
    if kept >= fp:
        return f"ops never free memory, so {m} microbatches need {m}×{fp:g} = {need:g} on a device"
    return (f"a microbatch's backward frees only {fp - kept:g} of the {fp:g} its forwards add, so "
            f"{m} microbatches need at least {m - 1}×{kept:g} + {fp:g} = {need:g} on a device")


def evaluate(problem: Problem, orders: Sequence[Sequence[Op]]) -> Score | None:
    """Makespan and longest span of `orders` run as soon as possible; None on deadlock.

    Same rules as `flowkit.planner.simulate` [Note: pipeline dependencies], on flat arrays.
    """
    S, m, comm = problem.stages, problem.microbatches, problem.costs.comm
    dev = problem.placement.stage_to_device
    c = problem.costs
    cost = (c.F, c.B, c.W, [b + w for b, w in zip(c.B, c.W)])
    end_f = [-1.0] * (S * m)
    end_b = [-1.0] * (S * m)
    pos = [0] * len(orders)
    free = [0.0] * len(orders)
    first = [-1.0] * len(orders)
    progress = True
    while progress:
        progress = False
        for d, ops in enumerate(orders):
            i, t_free, n = pos[d], free[d], len(ops)
            while i < n:
                k, s, mb = ops[i]
                if k == F:
                    if s == 0:
                        ready = 0.0
                    else:
                        ready = end_f[(s - 1) * m + mb]
                        if ready < 0:
                            break
                        if dev[s - 1] != d:
                            ready += comm
                elif k == W:
                    ready = end_b[s * m + mb]
                    if ready < 0:
                        break
                elif s == S - 1:
                    ready = end_f[s * m + mb]
                    if ready < 0:
                        break
                else:
                    ready = end_b[(s + 1) * m + mb]
                    if ready < 0:
                        break
                    if dev[s + 1] != d:
                        ready += comm
                start = t_free if t_free > ready else ready
                if i == 0:
                    first[d] = start
                t_free = start + cost[k][s]
                if k == F:
                    end_f[s * m + mb] = t_free
                elif k != W:
                    end_b[s * m + mb] = t_free
                i += 1
            if i != pos[d]:
                pos[d], free[d], progress = i, t_free, True
    if any(p != len(ops) for p, ops in zip(pos, orders)):
        return None
    spans = [free[d] - first[d] for d in range(len(orders)) if orders[d]]
    return Score(max(free), max(spans))


@attrs.frozen(kw_only=True)
class Rule:
    """How `list_schedule` breaks ties; every rule keeps each device's memory within `cap`."""

    cap: float  # peak memory per device; >= Problem.footprint
    # Wait for a backward that arrives within half a forward instead of starting that forward:
    # the backward unblocks the upstream device, the forward only this device's future.
    b_hold: bool = False
    # "fit": run a W only if it ends before the next op this device knows it will be able to run
    # (the Zero Bubble heuristic's gap filling); "eager": run a W whenever nothing else is ready.
    w_fill: str = "fit"


class _State:
    """Mutable bookkeeping of one `list_schedule` run (flat lists: this is the hot loop)."""

    def __init__(self, problem: Problem, rule: Rule) -> None:
        P, S, m = problem.devices, problem.stages, problem.microbatches
        self.rule, self.m, self.S = rule, m, S
        dev = self.dev = problem.placement.stage_to_device
        self.stages_on = [problem.placement.stages_on(d) for d in range(P)]
        self.delta = problem.deltas
        self.fp = problem.delta(F) * problem.placement.chunks
        c = problem.costs
        self.cost = (c.F, c.B, c.W)
        # Comm into stage s from its upstream (forward) and downstream (backward) neighbour.
        self.hop_f = [c.comm if s > 0 and dev[s - 1] != dev[s] else 0.0 for s in range(S)]
        self.hop_b = [c.comm if s < S - 1 and dev[s + 1] != dev[s] else 0.0 for s in range(S)]
        self.count = ([0] * S, [0] * S, [0] * S)  # F, B, W run so far per stage
        self.end_f, self.end_b = [-1.0] * (S * m), [-1.0] * (S * m)
        self.free, self.mem, self.reserved = [0.0] * P, [0.0] * P, [0.0] * P
        self.orders: list[list[Op]] = [[] for _ in range(P)]

    def f_ready(self, s: int, k: int) -> float:
        """When F(s, k) can start on dependencies alone; negative if not yet known."""
        if s == 0:
            return 0.0
        end = self.end_f[(s - 1) * self.m + k]
        return end + self.hop_f[s] if end >= 0 else -1.0

    def b_ready(self, s: int, k: int) -> float:
        if s == self.S - 1:
            return self.end_f[s * self.m + k]
        end = self.end_b[(s + 1) * self.m + k]
        return end + self.hop_b[s] if end >= 0 else -1.0

    def f_fits(self, d: int, s: int) -> bool:
        # Only a device's first stage starts a microbatch there [Note: memory reservation].
        if s != self.stages_on[d][0]:
            return True
        return self.mem[d] + self.reserved[d] + self.fp <= self.rule.cap + _EPS

    def run(self, d: int, kind: int, s: int, ready: float) -> None:
        counts = self.count[kind]
        k = counts[s]
        counts[s] = k + 1
        start = self.free[d] if self.free[d] > ready else ready
        end = self.free[d] = start + self.cost[kind][s]
        self.mem[d] += self.delta[kind]
        if kind == F:
            self.end_f[s * self.m + k] = end
            first = s == self.stages_on[d][0]
            self.reserved[d] += self.fp - self.delta[F] if first else -self.delta[F]
        elif kind == B:
            self.end_b[s * self.m + k] = end
        self.orders[d].append((kind, s, k))


def _decide(st: _State, d: int, t: float) -> tuple[int, int, float] | float | None:
    """The op device `d` runs next (kind, stage, ready), or the time to look again, or None to
    sleep until a neighbour enables something."""
    if st.free[d] > t:
        t = st.free[d]
    rule, m = st.rule, st.m
    nf, nb, nw = st.count
    best_b = best_f = None
    future = fut_b = math.inf
    f_blocked = False
    for s in st.stages_on[d]:
        if nb[s] < nf[s]:
            r = st.b_ready(s, nb[s])
            if 0 <= r <= t + _EPS:
                if best_b is None or nb[s] < nb[best_b[1]]:
                    best_b = (B, s, r)
            elif r >= 0:
                future, fut_b = min(future, r), min(fut_b, r)
        if nf[s] < m:
            r = st.f_ready(s, nf[s])
            if r < 0:
                continue
            if not st.f_fits(d, s):
                f_blocked = True
            elif r <= t + _EPS:
                best_f = (F, s, r)  # stages ascend, so the deepest ready forward wins
            elif r < future:
                future = r
    if best_b is not None:
        return best_b
    w_stage = None
    for s in st.stages_on[d]:
        if nw[s] < nb[s] and (
                w_stage is None or st.end_b[s * m + nw[s]] < st.end_b[w_stage * m + nw[w_stage]]):
            w_stage = s
    if best_f is not None:
        if not (rule.b_hold and fut_b < t + st.cost[F][best_f[1]] / 2):
            return best_f
        future = fut_b
    if w_stage is None:
        return future if future < math.inf else None
    if f_blocked or rule.w_fill == "eager" or t + st.cost[W][w_stage] <= future + _EPS:
        return (W, w_stage, 0.0)
    return future


def list_schedule(problem: Problem, rule: Rule) -> list[list[Op]] | None:
    """Greedy list scheduling: each device, when free, runs a ready B, else a ready F that fits
    in memory, else a W (per `rule`); None if the cap is below one microbatch's footprint."""
    if rule.cap < problem.footprint - _EPS:
        return None
    st = _State(problem, rule)
    P = problem.devices
    version = [0] * P
    wake = [0.0] * P
    heap = [(0.0, d, 0) for d in range(P)]
    left = 3 * problem.stages * problem.microbatches
    while heap:
        t, d, v = heapq.heappop(heap)
        if v != version[d]:
            continue
        choice = _decide(st, d, t)
        version[d] += 1
        if choice is None:
            wake[d] = math.inf
            continue
        if isinstance(choice, float):
            wake[d] = choice
            heapq.heappush(heap, (choice, d, version[d]))
            continue
        kind, s, ready = choice
        st.run(d, kind, s, ready)
        left -= 1
        wake[d] = st.free[d]
        heapq.heappush(heap, (st.free[d], d, version[d]))
        for nd in _woken(st, kind, s):
            when = st.free[nd]
            if when < wake[nd] - _EPS:
                version[nd] += 1
                wake[nd] = when
                heapq.heappush(heap, (when, nd, version[nd]))
    return st.orders if left == 0 else None


def _woken(st: _State, kind: int, s: int) -> list[int]:
    """Devices whose next op may have just become ready (they re-decide no earlier than now)."""
    if kind == F:
        return [st.dev[s + 1]] if s + 1 < st.S else []
    if kind == B:
        return [st.dev[s - 1]] if s > 0 else []
    return []
