"""Several models' pipelines fused into one schedule on shared devices (Zhong et al., "RLHFuse:
Efficient RLHF Training for Large Language Models with Inter- and Intra-Stage Fusion", 2024:
intra-stage fusion of the actor's and the critic's training pipelines).

The design: [Note: fused schedules] below.
"""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import attrs

from flowkit.planner.ir import Action, ActionKey, Costs, Kind, MemoryModel, Schedule, action_key
from flowkit.planner.simulate import ScheduleError, SimResult, dependencies, summarize, timeline

__all__ = ["FusedSchedule", "fuse", "fused_report", "sequential", "simulate_fused"]

# [Note: fused schedules] PPO trains two models, the actor and the critic, each with its own
# pipeline; where their stages share devices, one model's bubbles can run the other's
# microbatches. A `FusedSchedule` keeps each model's own schedule and adds where each model's
# devices are (`devices[m][d]`) and one list of (model, action) a shared device, which
# interleaves the models' lists without reordering any of them. Keeping each model's order keeps
# the math: its gradients accumulate in its own schedule's order, so the parameters are the
# separate runs' bit for bit, and only time is shared (an action waits for its own model's
# actions only, `timeline`). `fuse` list-schedules candidates (which never deadlock), keeps those
# within the memory cap, takes the shortest and improves it by local search; the models one after
# the other is always a candidate and fits where each fits alone, so fusing is never worse than
# running the pipelines in turn. In full: docs/schedules.md, "Fusing two models' pipelines".

Placed = tuple[int, Action]  # (model, action)


def _as_placed(ops) -> tuple[tuple[Placed, ...], ...]:
    return tuple(tuple((int(m), a) for m, a in device) for device in ops)


def _as_devices(devices) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(d) for d in model) for model in devices)


@attrs.frozen(kw_only=True)
class FusedSchedule:
    """Several models' schedules on shared devices: each model's device d runs on shared device
    `devices[m][d]`, and each shared device runs `device_ops[device]` in order
    [Note: fused schedules]."""

    schedules: tuple[Schedule, ...] = attrs.field(converter=tuple)
    devices: tuple[tuple[int, ...], ...] = attrs.field(converter=_as_devices)
    device_ops: tuple[tuple[Placed, ...], ...] = attrs.field(converter=_as_placed)
    names: tuple[str, ...] = attrs.field(converter=tuple, default=())

    def __attrs_post_init__(self) -> None:
        _check_devices(self.schedules, self.devices, self.names)
        if len(self.device_ops) != self.num_devices:
            raise ValueError(f"a fused schedule on {self.num_devices} devices needs as many "
                             f"action lists, got {len(self.device_ops)}")
        for m, schedule in enumerate(self.schedules):
            for d, shared in enumerate(self.devices[m]):
                got = tuple(a for model, a in self.device_ops[shared] if model == m)
                if got != schedule.device_ops[d]:
                    raise ValueError(
                        f"device {shared} must run {self.name(m)}'s device {d} actions in "
                        f"their own order ({' '.join(map(str, schedule.device_ops[d]))}), got "
                        f"{' '.join(map(str, got))}")
            for shared in set(range(self.num_devices)) - set(self.devices[m]):
                if any(model == m for model, _ in self.device_ops[shared]):
                    raise ValueError(f"device {shared} lists actions of {self.name(m)}, which "
                                     "has no device there")

    @property
    def num_devices(self) -> int:
        return 1 + max(d for model in self.devices for d in model)

    @property
    def microbatches(self) -> int:
        return max(s.microbatches for s in self.schedules)

    def name(self, model: int) -> str:
        return self.names[model] if self.names else f"model {model}"

    def text(self) -> list[list[str]]:
        """Each device's actions as ``{model}:{action}`` (names where given)."""
        label = self.names or [str(m) for m in range(len(self.schedules))]
        return [[f"{label[m]}:{a}" for m, a in ops] for ops in self.device_ops]


def _check_devices(schedules: Sequence[Schedule], devices: Sequence[Sequence[int]],
                   names: Sequence[str]) -> None:
    if not schedules:
        raise ValueError("fusing needs at least one schedule")
    if len(devices) != len(schedules) or (names and len(names) != len(schedules)):
        raise ValueError(f"{len(schedules)} schedules need as many device maps (got "
                         f"{len(devices)}) and names (got {len(names)})")
    used: set[int] = set()
    for m, (schedule, mapped) in enumerate(zip(schedules, devices)):
        label = names[m] if names else f"model {m}"
        if len(mapped) != schedule.num_devices:
            raise ValueError(f"{label}'s schedule has {schedule.num_devices} devices but its "
                             f"device map names {len(mapped)}")
        if len(set(mapped)) != len(mapped) or min(mapped) < 0:
            raise ValueError(f"{label}'s devices must be distinct shared devices (one stage "
                             f"list a device), got {list(mapped)}")
        used.update(mapped)
    if used != set(range(len(used))):
        raise ValueError(f"shared devices must be numbered 0..n-1, got {sorted(used)}")


def _costs(costs: Costs | Sequence[Costs], count: int) -> list[Costs]:
    return [costs] * count if isinstance(costs, Costs) else list(costs)


def _memories(memory: MemoryModel | Sequence[MemoryModel] | None, count: int) -> list:
    if memory is None or isinstance(memory, MemoryModel):
        return [memory or MemoryModel()] * count
    return list(memory)


def simulate_fused(fused: FusedSchedule, costs: Costs | Sequence[Costs],
                   memory: MemoryModel | Sequence[MemoryModel] | None = None,
                   scale: Sequence[float] | None = None) -> SimResult:
    """Run `fused` with each model's per-stage `costs` (one Costs for all alike); a device's
    memory is its models' sum, model m's counted by `memory[m]` times `scale[m]`. Intervals
    say their model."""
    count = len(fused.schedules)
    costs, memories = _costs(costs, count), _memories(memory, count)
    scale = list(scale) if scale is not None else [1.0] * count
    for m, schedule in enumerate(fused.schedules):
        if costs[m].num_stages != schedule.num_stages:
            raise ValueError(f"{fused.name(m)}'s costs cover {costs[m].num_stages} stages, its "
                             f"schedule has {schedule.num_stages}")
    chunks = [s.placement.chunks for s in fused.schedules]
    out, copies = timeline(fused.device_ops, stages=[s.num_stages for s in fused.schedules],
                           costs=costs, names=fused.names or ())
    return summarize(out, copies,
                     lambda iv: memories[iv.model].delta(iv.action, chunks[iv.model])
                     * scale[iv.model],
                     lambda iv: memories[iv.model].offloaded(chunks[iv.model]) * scale[iv.model])


def sequential(schedules: Sequence[Schedule], devices: Sequence[Sequence[int]] | None = None,
               names: Sequence[str] = (), order: Sequence[int] | None = None) -> FusedSchedule:
    """The models one after the other on each device (in `order`, by default as given)."""
    devices = devices if devices is not None else [range(s.num_devices) for s in schedules]
    devices = _as_devices(devices)
    _check_devices(schedules, devices, names)
    lists: dict[int, list[Placed]] = defaultdict(list)
    for m in order if order is not None else range(len(schedules)):
        for d, shared in enumerate(devices[m]):
            lists[shared] += [(m, a) for a in schedules[m].device_ops[d]]
    return FusedSchedule(schedules=schedules, devices=devices, names=names,
                         device_ops=[lists[d] for d in range(len(lists))])


# -- list scheduling ----------------------------------------------------------------------------
Priority = Callable[[int, Action, int], tuple]  # (model, action, work left of it) -> sort key


def _priorities(count: int) -> dict[str, Priority]:
    def first(model: int) -> Priority:
        return lambda m, a, left: (m != model,)

    out = {f"first{m}": first(m) for m in range(count)}
    out["most-left"] = lambda m, a, left: (-left,)
    out["backward-first"] = lambda m, a, left: (a.kind is Kind.F, -left)
    return out


def _list_schedule(schedules: Sequence[Schedule], devices: Sequence[Sequence[int]],
                   costs: Sequence[Costs], delta: Callable[[int, Action], float],
                   cap: float, priority: Priority) -> list[list[Placed]] | None:
    """Interleave the models' lists by list scheduling (see [Note: fused schedules]); None
    where the cap leaves nothing that can run."""
    shared = 1 + max(d for model in devices for d in model)
    queues: list[list[tuple[int, tuple[Action, ...]]]] = [[] for _ in range(shared)]
    for m, schedule in enumerate(schedules):
        for d, device in enumerate(devices[m]):
            queues[device].append((m, schedule.device_ops[d]))
    position = [[0] * len(q) for q in queues]
    left = [[sum(costs[m].of(a) for a in ops if not a.kind.is_copy) for m, ops in q]
            for q in queues]
    ends: dict[tuple[int, ActionKey], tuple[float, int]] = {}
    free = [0.0] * shared
    level = [0.0] * shared
    out: list[list[Placed]] = [[] for _ in range(shared)]
    total = sum(len(ops) for q in queues for _, ops in q)
    done = 0
    while done < total:
        best = None
        for device, queue in enumerate(queues):
            for slot, (m, ops) in enumerate(queue):
                at = position[device][slot]
                if at == len(ops):
                    continue
                action = ops[at]
                start = free[device]
                ready = True
                for stage, kind, mb in dependencies(action, schedules[m].num_stages):
                    dep = ends.get((m, action_key(stage, kind, mb)))
                    if dep is None:
                        ready = False
                        break
                    start = max(start, dep[0] + (costs[m].comm if dep[1] != device else 0.0))
                if not ready or (not action.kind.is_copy
                                 and level[device] + delta(m, action) > cap + 1e-9):
                    continue
                # starts equal but for float rounding tie, and the priority decides
                key = (round(start, 9), priority(m, action, left[device][slot]), device, slot)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        start, _, device, slot = best
        m, ops = queues[device][slot]
        # the action, and the copies that follow it in its model's list (it issues them)
        while True:
            action = ops[position[device][slot]]
            position[device][slot] += 1
            done += 1
            out[device].append((m, action))
            if action.kind.is_copy:
                ends[(m, action.key)] = (start, device)  # a guess: the simulator times them
            else:
                end = start + costs[m].of(action)
                ends[(m, action.key)] = (end, device)
                free[device] = end
                level[device] += delta(m, action)
                left[device][slot] -= costs[m].of(action)
            at = position[device][slot]
            if at == len(ops) or not ops[at].kind.is_copy:
                break
    return out


# -- the search ---------------------------------------------------------------------------------
@attrs.frozen
class _Scored:
    fused: FusedSchedule
    makespan: float
    span: float
    peak: float

    def better_than(self, other: _Scored) -> bool:
        if not math.isclose(self.makespan, other.makespan, rel_tol=1e-12, abs_tol=1e-12):
            return self.makespan < other.makespan
        return self.span < other.span - 1e-12


def fuse(schedules: Sequence[Schedule], costs: Costs | Sequence[Costs], *,
         devices: Sequence[Sequence[int]] | None = None,
         memory: MemoryModel | Sequence[MemoryModel] | None = None,
         scale: Sequence[float] | None = None, memory_limit: float | None = None,
         names: Sequence[str] = (), evals: int | None = None, seconds: float = 2.0,
         seed: int = 0) -> FusedSchedule:
    """The shortest interleaving found of `schedules` on shared devices (each model's device d
    on `devices[m][d]`; by default device d of every model on device d), within `memory_limit`
    on every device [Note: fused schedules]. Raises ScheduleError (over_memory) when not even
    one model after the other fits."""
    count = len(schedules)
    devices = _as_devices(devices if devices is not None
                          else [range(s.num_devices) for s in schedules])
    _check_devices(schedules, devices, names)
    costs, memories = _costs(costs, count), _memories(memory, count)
    scale = list(scale) if scale is not None else [1.0] * count
    cap = math.inf if memory_limit is None else memory_limit

    def score(fused: FusedSchedule) -> _Scored | None:
        try:
            result = simulate_fused(fused, costs, memories, scale)
        except ScheduleError:
            return None
        return _Scored(fused, result.makespan, max(result.device_span),
                       max(result.peak_memory))

    chunks = [s.placement.chunks for s in schedules]

    def delta(model: int, action: Action) -> float:
        return memories[model].delta(action, chunks[model]) * scale[model]

    candidates = [sequential(schedules, devices, names, order)
                  for order in (range(count), range(count - 1, -1, -1))]
    stop = time.perf_counter() + seconds
    for priority in _priorities(count).values():
        if time.perf_counter() > stop:  # `seconds` bounds the candidates and the search
            break
        ops = _list_schedule(schedules, devices, costs, delta, cap, priority)
        if ops is not None:
            candidates.append(FusedSchedule(schedules=schedules, devices=devices,
                                            device_ops=ops, names=names))
    scored = [s for s in map(score, candidates) if s is not None and s.peak <= cap + 1e-9]
    if not scored:
        peak = max(simulate_fused(candidates[0], costs, memories, scale).peak_memory)
        raise ScheduleError(f"the fused models need memory {peak:g} a device even one "
                            f"after the other, over the limit {memory_limit:g}: raise the "
                            "limit or give each model a schedule that needs less",
                            over_memory=True)
    best = min(scored, key=lambda s: (s.makespan, s.span))
    total = sum(len(ops) for ops in best.fused.device_ops)
    budget = evals if evals is not None else max(20, min(300, 60_000 // max(total, 1)))
    left = max(0.0, stop - time.perf_counter())
    return _improve(best, score, cap, budget, left, seed).fused


def _improve(best: _Scored, score: Callable[[FusedSchedule], _Scored | None], cap: float,
             evals: int, seconds: float, seed: int) -> _Scored:
    """Local search over the interleaving: moves across models only, kept when no worse (so
    that it walks across plateaus of equal makespan, which strict gains stop at)."""
    rng = random.Random(seed)
    stop = time.perf_counter() + seconds
    lists = [list(ops) for ops in best.fused.device_ops]
    for _ in range(evals):
        if time.perf_counter() > stop:
            break
        device = rng.randrange(len(lists))
        new = _move(rng, lists[device])
        if new is None:
            continue
        trial = [*lists[:device], new, *lists[device + 1:]]
        try:
            fused = attrs.evolve(best.fused, device_ops=trial)
        except ValueError:
            continue
        got = score(fused)
        if got is None or got.peak > cap + 1e-9:
            continue
        if not best.better_than(got):  # better, or as good: walks a plateau too
            best, lists = got, trial
    return best


def _move(rng: random.Random, ops: list[Placed]) -> list[Placed] | None:
    """Move a run of one to three of one model's compute actions, each with the copies listed
    after it (it issues them), past one to four of the other models' actions next to it:
    every model's own order stays. A run moves where one action alone cannot: an F and the
    backward after it, when either alone would only wait longer."""
    units: list[list[Placed]] = []
    for placed in ops:
        if placed[1].kind.is_copy and units:
            units[-1].append(placed)
        else:
            units.append([placed])
    if len(units) < 2:
        return None
    i = rng.randrange(len(units))
    model = units[i][0][0]
    j, length = i + 1, rng.randint(1, 3)
    while j < len(units) and j - i < length and units[j][0][0] == model:
        j += 1
    run, rest = units[i:j], units[:i] + units[j:]
    at, step = i, rng.choice((-1, 1))
    for _ in range(rng.randint(1, 4)):
        neighbour = at - 1 if step < 0 else at
        if not 0 <= neighbour < len(rest) or rest[neighbour][0][0] == model:
            break
        at += step
    if at == i:
        return None
    moved = rest[:at] + run + rest[at:]
    return [placed for unit in moved for placed in unit]


def fused_report(fused: FusedSchedule, costs: Costs | Sequence[Costs],
                 memory: MemoryModel | Sequence[MemoryModel] | None = None,
                 scale: Sequence[float] | None = None) -> dict:
    """Each model's pipeline alone (makespan, bubble rate, peak), their makespans' sum and the
    fused schedule's: what fusing buys."""
    count = len(fused.schedules)
    costs, memories = _costs(costs, count), _memories(memory, count)
    scale = list(scale) if scale is not None else [1.0] * count
    alone = []
    for m, schedule in enumerate(fused.schedules):
        result = simulate_fused(
            FusedSchedule(schedules=[schedule], devices=[range(schedule.num_devices)],
                          device_ops=[[(0, a) for a in ops] for ops in schedule.device_ops]),
            [costs[m]], [memories[m]], [scale[m]])
        alone.append({"name": fused.name(m), "kind": schedule.kind, **result.to_json()})
    result = simulate_fused(fused, costs, memories, scale)
    return {"models": alone, "sum_makespan": sum(a["makespan"] for a in alone),
            "fused": result.to_json()}
