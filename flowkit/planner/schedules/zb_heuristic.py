"""The Zero Bubble paper's automatic schedule (ZB-1p / ZB-2p): a port of sail-sg's
`Graph.manual_order` and `initial_solution` (megatron/core/pipeline_parallel/zerobubble/scheduler/
zb.py), with per-stage costs as in the original and memory in `MemoryModel` units.

The original builds one "wave" per microbatch: every stage takes its next F (if the F does not
stall the B coming back from downstream), then every stage, last to first, takes its next B, and W's
fill the gaps until each dependency arrives. `initial_solution` tries the 8 combinations of three
flags and keeps the one with the shortest longest stage span. The paper's Table 5 ZB-1p and ZB-2p
columns are exactly this heuristic's output (its ILP refinement is disabled in the shipped code).
One stage per device only.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

from flowkit.planner.schedules.greedy import B, F, Op, Problem, W, evaluate

__all__ = ["FLAGS", "manual_order", "zb_heuristic"]

# (allow_bubble_before_first_b, prioritize_b, no_bubble_greedy), in the original's order.
FLAGS = tuple(itertools.product((True, False), repeat=3))


class _CannotFit(ValueError):
    pass


class _Waves:
    """State of one `manual_order` run; names follow the original (f, b, w, m, e, t)."""

    def __init__(self, problem: Problem, max_mem: float) -> None:
        S = self.S = problem.stages
        self.M, self.comm, self.max_mem = problem.microbatches, problem.costs.comm, max_mem
        c = problem.costs
        self.cost = (c.F, c.B, c.W)
        self.mem = problem.deltas
        self.count = ([0] * S, [0] * S, [0] * S)  # f, b, w
        self.m, self.e, self.bubble = [0.0] * S, [0.0] * S, [0.0] * S
        # End times. The original keeps them in a zero-filled list, so a dependency its warm-up
        # has not placed yet (when the last stage runs out of microbatches) reads as time 0; so
        # does this port, and the simulator then times the resulting order correctly.
        self.t: defaultdict[tuple[int, int, int], float] = defaultdict(float)
        self.order: list[list[Op]] = [[] for _ in range(S)]

    def put(self, j: int, k: int) -> None:
        i = self.count[k][j]
        end = no_bubble = self.e[j] + self.cost[k][j]
        if k == F and j > 0:
            end = max(end, self.t[(F, j - 1, i)] + self.comm + self.cost[k][j])
        if k == B and j < self.S - 1:
            end = max(end, self.t[(B, j + 1, i)] + self.comm + self.cost[k][j])
        if self.count[F][j] > 0:  # idle time only counts after the stage's first F
            self.bubble[j] += end - no_bubble
        self.e[j] = self.t[(k, j, i)] = end
        self.m[j] += self.mem[k]
        self.count[k][j] += 1
        self.order[j].append((k, j, i))

    def pending_w(self, j: int) -> bool:
        return self.count[W][j] < self.count[B][j]

    def free_for(self, j: int, k: int) -> None:
        """Run W's until an op of kind k fits in memory."""
        while self.m[j] + self.mem[k] > self.max_mem:
            if not self.pending_w(j):
                raise _CannotFit("Cannot fit memory")
            self.put(j, W)

    def fill_until(self, j: int, deadline: float, no_bubble_greedy: bool) -> None:
        """Run W's that end by `deadline`; then one more unless the gap left is affordable."""
        while self.pending_w(j) and self.e[j] + self.cost[W][j] <= deadline:
            self.put(j, W)
        if self.pending_w(j) and self.e[j] < deadline:
            if deadline - self.e[j] <= max(self.bubble) - self.bubble[j]:
                if no_bubble_greedy:
                    self.put(j, W)
            else:
                self.put(j, W)


def _warmup(z: _Waves, allow_bubble_before_first_b: bool) -> None:
    """Microbatch 0: F0 everywhere, then as many extra F's per stage as fit before B0 returns."""
    S, M, cf, cb, comm = z.S, z.M, z.cost[F], z.cost[B], z.comm
    for j in range(S):
        z.put(j, F)
    fr = [0] * S
    last_t = z.t[(F, S - 1, 0)] + cb[S - 1]
    for j in range(S - 2, -1, -1):
        mem, c = z.m[j], z.e[j]
        while z.count[F][j] + fr[j] < M and mem + z.mem[F] <= z.max_mem:
            if allow_bubble_before_first_b:
                if c + cf[j] > last_t + comm:
                    break
            elif c >= last_t + comm:
                break
            mem, c, fr[j] = mem + z.mem[F], c + cf[j], fr[j] + 1
        last_t = max(c, last_t + comm) + cb[j]
    for j in range(1, S):  # strictly fewer extra F's down the pipeline
        while fr[j] > 0 and fr[j] >= fr[j - 1] and z.count[F][j] + fr[j] < M:
            fr[j] -= 1
    for j in range(S):
        for _ in range(fr[j]):
            z.put(j, F)
    for j in range(S - 1, -1, -1):
        z.put(j, B)


def _wants_f(z: _Waves, j: int, prioritize_b: bool) -> bool:
    f, b, w = z.count
    if j + 1 < z.S and f[j] >= f[j + 1] + 2 and prioritize_b:
        cf, cb, cw = z.cost
        next_plus_fw = z.e[j + 1] + cf[j + 1] + cb[j + 1] + z.comm
        if z.e[j] >= next_plus_fw:
            return False
        w_cost, w_cnt, mem_with_w = 0.0, 0, z.m[j] + z.mem[F]
        while mem_with_w > z.max_mem and w[j] + w_cnt < b[j]:
            w_cost, mem_with_w, w_cnt = w_cost + cw[j], mem_with_w + z.mem[W], w_cnt + 1
        if z.e[j] + cf[j] + w_cost <= next_plus_fw:
            return True
        if next_plus_fw - z.e[j] <= max(z.bubble) - z.bubble[j]:
            return False
    return True


def _wave(z: _Waves, i: int, prioritize_b: bool, no_bubble_greedy: bool) -> None:
    """Microbatch i >= 1: the F's that do not stall a B, then B_i on every stage, last first."""
    S, f = z.S, z.count[F]
    fr = [1 if f[j] < z.M and _wants_f(z, j, prioritize_b) else 0 for j in range(S)]
    for j in range(S - 2, -1, -1):
        fr[j] = min(fr[j], fr[j + 1])
    for j in range(S):
        if fr[j]:
            z.free_for(j, F)
            if j > 0:
                z.fill_until(j, z.t[(F, j - 1, f[j])] + z.comm, no_bubble_greedy)
            z.put(j, F)
    for j in range(S - 1, -1, -1):
        z.free_for(j, B)
        if j + 1 < S:
            z.fill_until(j, z.t[(B, j + 1, i)] + z.comm, no_bubble_greedy)
        if j == 0 and f[0] == z.M:
            while z.pending_w(0):
                z.put(0, W)
        z.put(j, B)


def manual_order(problem: Problem, max_mem: float, allow_bubble_before_first_b: bool,
                 prioritize_b: bool, no_bubble_greedy: bool) -> list[list[Op]]:
    """One run of the heuristic; raises ValueError when memory cannot fit (as the original)."""
    if problem.placement.chunks != 1:
        raise ValueError("the Zero Bubble heuristic places one stage per device")
    z = _Waves(problem, max_mem)
    _warmup(z, allow_bubble_before_first_b)
    for i in range(1, z.M):
        _wave(z, i, prioritize_b, no_bubble_greedy)
    for j in range(z.S):
        while z.count[W][j] < z.M:
            z.put(j, W)
    return z.order


def zb_heuristic(problem: Problem, memory_limit: float | None) -> list[list[Op]] | None:
    """Best of the 8 flag combinations by the longest stage span (the original's criterion,
    first wins ties); None if none fits. `memory_limit` None means the original's default."""
    max_mem = (
        memory_limit if memory_limit is not None else 3 * problem.microbatches * problem.delta(F))
    best: tuple[float, list[list[Op]]] | None = None
    for flags in FLAGS:
        try:
            order = manual_order(problem, max_mem, *flags)
        except _CannotFit:
            continue
        score = evaluate(problem, order)
        if score is not None and (best is None or score.span < best[0]):
            best = (score.span, order)
    return best[1] if best else None
