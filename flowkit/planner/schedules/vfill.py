"""A V schedule built forward in time, W's moved into the waits: a candidate for `zb-v`.

[Note: bubble-filling V] The fixed ZB-V order is zero-bubble only when F = B = W and comm is
free; list scheduling (greedy.py) knows the costs but not the V's rhythm. This builder keeps the
rhythm and watches the clock, as the Zero Bubble authors' V scheduler does (Qi et al., "Zero
Bubble Pipeline Parallelism", ICLR 2024, and their repository's ZB-V search): a warm-up that
fills each device with down-stage forwards while they fit before its up stage can start; a
steady state of backward then forward on every device, pending W's run in the waits for a
neighbour (and before an op that would pass the memory cap); and tries that take the devices'
bubbles of one try as the allowance of the next while the worst bubble shrinks. Each of four
variants is a candidate that the caller's simulator judges, so the clock here only has to
steer. The steps in full: docs/schedules.md, "How the bubble-filling V is built".
"""

from __future__ import annotations

from collections import deque

from flowkit.planner.schedules.greedy import B, F, Op, Problem, W

__all__ = ["fill_v_orders"]

Orders = list[list[Op]]
_DOWN, _UP = 0, 1  # a device's two stages: d, then 2p-1-d on the way back
_TRIES = 6  # allowance refinements (step 3); the held-out cases stop at the second


class _Infeasible(Exception):
    """The construction cannot go on within the cap (it drops the candidate)."""


class _Builder:
    def __init__(self, problem: Problem, cap: float, fill_f: bool, fill_b: bool,
                 allowed: list[float] | None) -> None:
        self.p, self.m = problem.devices, problem.microbatches
        self.problem, self.cap = problem, cap
        self.fill_f, self.fill_b = fill_f, fill_b
        self.allowed = allowed  # each device's bubble in the try before, if any
        self.comm = problem.costs.comm
        self.clock = [0.0] * self.p
        self.mem = [0.0] * self.p
        self.bubble = [0.0] * self.p
        self.started = [False] * self.p
        self.done = [[[0, 0] for _ in range(3)] for _ in range(self.p)]  # [kind][chunk]
        self.end: dict[tuple[int, int, int], float] = {}  # (kind F/B, stage, microbatch)
        self.pending: list[deque[tuple[int, int]]] = [deque() for _ in range(self.p)]
        self.orders: Orders = [[] for _ in range(self.p)]

    # -- the V's geometry ----------------------------------------------------------------------
    def stage(self, d: int, chunk: int) -> int:
        return d if chunk == _DOWN else 2 * self.p - 1 - d

    def needs(self, kind: int, d: int, chunk: int, mb: int) -> tuple[float | None, bool]:
        """When op (kind, d's chunk, mb) may start by its dependency, and whether the
        dependency is on another device (None: not placed yet; 0.0: none)."""
        p = self.p
        if kind == F:
            if chunk == _DOWN:
                return (0.0, False) if d == 0 else (self.end.get((F, d - 1, mb)), True)
            if d == p - 1:
                return self.end.get((F, d, mb)), False
            return self.end.get((F, self.stage(d + 1, _UP), mb)), True
        if chunk == _UP:
            if d == 0:
                return self.end.get((F, 2 * p - 1, mb)), False
            return self.end.get((B, self.stage(d - 1, _UP), mb)), True
        if d == p - 1:
            return self.end.get((B, p, mb)), False
        return self.end.get((B, d + 1, mb)), True

    def ready_at(self, kind: int, d: int, chunk: int, mb: int) -> float | None:
        at, remote = self.needs(kind, d, chunk, mb)
        return None if at is None else at + (self.comm if remote else 0.0)

    # -- placing ops ---------------------------------------------------------------------------
    def put(self, kind: int, d: int, chunk: int) -> None:
        mb = self.done[d][kind][chunk]
        if mb >= self.m:
            raise _Infeasible(f"device {d} has no microbatch left for {kind}/{chunk}")
        delta = self.problem.delta(kind)
        if self.mem[d] + delta > self.cap + 1e-9:
            raise _Infeasible(f"device {d} over its memory cap")
        stage = self.stage(d, chunk)
        cost = self.problem.cost(kind, stage)
        start = self.clock[d]
        if kind != W:
            ready = self.ready_at(kind, d, chunk, mb)
            if ready is None:
                raise _Infeasible(f"op {kind}/{stage}/{mb} before its dependency")
            if ready > start:
                if self.started[d]:
                    self.bubble[d] += ready - start
                start = ready
            self.end[(kind, stage, mb)] = start + cost
        self.clock[d] = start + cost
        self.started[d] = True
        self.mem[d] += delta
        self.done[d][kind][chunk] += 1
        self.orders[d].append((kind, stage, mb))
        if kind == B:
            self.pending[d].append((chunk, mb))

    def put_w(self, d: int) -> None:
        chunk, mb = self.pending[d].popleft()
        stage = self.stage(d, chunk)
        self.clock[d] += self.problem.cost(W, stage)
        self.mem[d] += self.problem.delta(W)
        self.orders[d].append((W, stage, mb))

    def room_for(self, kind: int, d: int) -> None:
        """W's until op `kind` fits the cap."""
        while self.mem[d] + self.problem.delta(kind) > self.cap + 1e-9:
            if not self.pending[d]:
                raise _Infeasible(f"device {d} cannot fit its next op")
            self.put_w(d)

    def allowance(self, d: int) -> float:
        worst = max(self.bubble)
        if self.allowed is not None:
            worst = max(worst, max(self.allowed) - self.allowed[d])
        return worst - self.bubble[d]

    def fill_then(self, kind: int, d: int, chunk: int, eager: bool) -> None:
        """Pending W's in the wait before op (kind, chunk), then the op."""
        mb = self.done[d][kind][chunk]
        at, remote = self.needs(kind, d, chunk, mb)
        if remote and at is not None:
            ready = at + self.comm
            w_cost = self.problem.cost(W, self.stage(d, chunk))
            while self.pending[d] and ready >= self.clock[d] + w_cost:
                self.put_w(d)
            if self.pending[d] and eager and ready - self.clock[d] > self.allowance(d):
                self.put_w(d)
        self.put(kind, d, chunk)

    # -- the phases ----------------------------------------------------------------------------
    def warm_up(self) -> None:
        p, m, f_mem = self.p, self.m, self.problem.delta(F)
        for d in range(p):
            self.put(F, d, _DOWN)
        for d in range(p - 1, -1, -1):
            if d < p - 1:
                turn = self.end[(F, self.stage(d + 1, _UP), 0)] + self.comm
                while (self.mem[d] + f_mem * (2 + 2 * d) <= self.cap + 1e-9
                       and self.clock[d] + self.problem.cost(F, d) <= turn
                       and self.done[d][F][_DOWN] < m):
                    for e in range(d + 1):
                        if self.done[e][F][_DOWN] < m:
                            self.put(F, e, _DOWN)
            self.put(F, d, _UP)
        chunk = _DOWN
        for d in range(1, p):
            while self.behind(d):
                for e in range(p - 1, d - 1, -1):
                    if self.done[e][F][chunk] < m:
                        self.put(F, e, chunk)
                chunk = 1 - chunk

    def behind(self, d: int) -> bool:
        """Whether device d has run fewer forwards than the one before it, or no more of the
        up stage while that one has some left."""
        mine, before = self.done[d][F], self.done[d - 1][F]
        return mine[0] + mine[1] < before[0] + before[1] or mine[1] <= before[1] < self.m

    def backward_round(self) -> None:
        p, m = self.p, self.m
        for d in range(p):
            self.room_for(B, d)
        up, down = [], []
        for d in range(p):
            done = self.done[d][B]
            if done[_DOWN] >= done[_UP]:
                up.append(d)
            elif d == p - 1 or done[_UP] >= m or (B, d + 1, done[_DOWN]) in self.end:
                down.append(d)
            else:
                up.append(d)
        for d, chunk in [(d, _DOWN) for d in reversed(down)] + [(d, _UP) for d in up]:
            if self.done[d][B][chunk] >= m or self.done[d][B][chunk] >= self.done[d][F][chunk]:
                continue
            self.fill_then(B, d, chunk, eager=chunk == _DOWN or self.fill_b)

    def forward_round(self) -> None:
        p, m = self.p, self.m
        for d in range(p):
            done = self.done[d][F]
            if done[_UP] >= m:
                continue
            if done[_UP] >= done[_DOWN]:
                chunk = _DOWN
            elif d == p - 1 or (F, self.stage(d + 1, _UP), done[_UP]) in self.end:
                chunk = _UP
            elif done[_DOWN] < m and (d == 0 or (F, d - 1, done[_DOWN]) in self.end):
                chunk = _DOWN
            else:
                continue
            self.room_for(F, d)
            self.fill_then(F, d, chunk, eager=self.fill_f)

    def build(self) -> Orders:
        self.warm_up()
        for _ in range(2 * self.m):
            self.backward_round()
            self.forward_round()
        for d in range(self.p):
            while self.pending[d]:
                self.put_w(d)
        return self.orders


def fill_v_orders(problem: Problem, cap: float, *, fill_f: bool,
                  fill_b: bool) -> Orders | None:
    """The bubble-filling V order within `cap` [Note: bubble-filling V], its allowance refined
    while the worst device bubble shrinks; None where the construction does not fit."""
    if problem.placement.chunks != 2 or problem.devices < 1:
        return None
    best: tuple[float, Orders] | None = None
    allowed = None
    for _ in range(_TRIES):  # each try must shrink the worst bubble
        builder = _Builder(problem, cap, fill_f, fill_b, allowed)
        try:
            orders = builder.build()
        except _Infeasible:
            break
        worst = max(builder.bubble)
        if best is not None and worst >= best[0] - 1e-9:
            break
        best, allowed = (worst, orders), list(builder.bubble)
    return None if best is None else best[1]
