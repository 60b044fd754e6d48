"""Check a schedule before anyone runs it: every op exactly once, on its device, no deadlock, memory
within the limit. Failures raise one ScheduleError listing every problem, followed by the schedule
drawn as a step x device grid with the offending actions in brackets (``[2B3]``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable

from flowkit.planner.ir import Action, Costs, Kind, MemoryModel, Schedule
from flowkit.planner.simulate import ScheduleError, SimResult, memory_levels, simulate

__all__ = ["render_grid", "validate"]

# Grids longer than this show only the rows around marked actions.
_MAX_ROWS = 40
_CONTEXT = 3


def render_grid(schedule: Schedule, marked: Collection[Action] = ()) -> str:
    """Rows are step indices, columns devices, cells action text; marked actions in brackets."""
    marked = frozenset(marked)
    depth = max((len(ops) for ops in schedule.device_ops), default=0)
    cells = [[_cell(ops[i], marked) if i < len(ops) else "" for ops in schedule.device_ops]
             for i in range(depth)]
    header = [f"dev {d}" for d in range(schedule.num_devices)]
    width = max([len(c) for row in cells for c in row] + [len(h) for h in header])
    step_width = max(len("step"), len(str(depth)))

    def line(label: str, row: Iterable[str]) -> str:
        return f"{label:>{step_width}} | " + " ".join(f"{c:^{width}}" for c in row)

    lines = [line("step", header)]
    previous = -1
    for i in _visible_rows(cells, depth):
        if i != previous + 1:
            lines.append(f"{'...':>{step_width}} |")
        lines.append(line(str(i), cells[i]))
        previous = i
    if previous != depth - 1:
        lines.append(f"{'...':>{step_width}} | ({depth} steps)")
    return "\n".join(lines)


def _cell(action: Action, marked: frozenset[Action]) -> str:
    return f"[{action}]" if action in marked else f" {action} "


def _visible_rows(cells: list[list[str]], depth: int) -> list[int]:
    if depth <= _MAX_ROWS:
        return list(range(depth))
    hot = [i for i, row in enumerate(cells) if any(c.startswith("[") for c in row)]
    if not hot:
        return list(range(_MAX_ROWS))
    keep = {j for i in hot for j in range(i - _CONTEXT, i + _CONTEXT + 1) if 0 <= j < depth}
    return sorted(keep)


def _fail(schedule: Schedule, problems: list[str], marked: Iterable[Action], *,
          over_memory: bool = False) -> ScheduleError:
    marked = list(marked)
    head = (f"schedule {schedule.kind!r}: {problems[0]}"
            if len(problems) == 1
            else f"schedule {schedule.kind!r} has {len(problems)} errors:\n"
            + "\n".join(f"  - {p}" for p in problems))
    grid = render_grid(schedule, marked)
    return ScheduleError(f"{head}\n\n{grid}", schedule=schedule, marked=marked, problems=problems,
                         over_memory=over_memory)


def _placement_problems(schedule: Schedule) -> tuple[list[str], list[Action]]:
    placement = schedule.placement
    problems, marked = [], []
    for device, ops in enumerate(schedule.device_ops):
        for step, action in enumerate(ops):
            if action.stage >= placement.num_stages:
                problems.append(f"{action} (device {device}, step {step}) names stage "
                                f"{action.stage}; there are {placement.num_stages} stages")
            elif placement.device_of(action.stage) != device:
                problems.append(f"{action} is on device {device}, but stage {action.stage} "
                                f"lives on device {placement.device_of(action.stage)}")
            elif action.microbatch >= schedule.microbatches:
                problems.append(f"{action} names microbatch {action.microbatch}; the schedule "
                                f"has {schedule.microbatches}")
            else:
                continue
            marked.append(action)
    return problems, marked


def _completeness_problems(schedule: Schedule) -> tuple[list[str], list[Action]]:
    """Each (stage, microbatch) needs F once and then either B and W once each, or BW once."""
    seen: dict[tuple[int, int], list[Kind]] = defaultdict(list)
    for ops in schedule.device_ops:
        for action in ops:
            seen[(action.stage, action.microbatch)].append(action.kind)
    problems, marked = [], []
    for stage in range(schedule.num_stages):
        for mb in range(schedule.microbatches):
            kinds = seen.get((stage, mb), [])
            for kind in Kind:
                if kinds.count(kind) > 1:
                    problems.append(f"{Action(stage, kind, mb)} appears {kinds.count(kind)} times")
                    marked.append(Action(stage, kind, mb))
            missing = _missing(kinds)
            if missing:
                problems.append(f"stage {stage} microbatch {mb} has no {missing}")
                marked.extend(Action(stage, k, mb) for k in set(kinds))
    return problems, marked


def _copy_problems(schedule: Schedule) -> tuple[list[str], list[Action]]:
    """An offload needs its prefetch and the reverse, and on its device the order F, O, P, then
    the backward (B or BW): a backward listed before its prefetch would read activations that
    are still in host memory [Note: offload in flowkit/planner/offload.py]."""
    problems: list[str] = []
    marked: list[Action] = []
    for device, ops in enumerate(schedule.device_ops):
        where = {(a.stage, a.kind, a.microbatch): i for i, a in enumerate(ops)}
        for i, action in enumerate(ops):
            if not action.kind.is_copy:
                continue
            s, mb = action.stage, action.microbatch
            if action.kind is Kind.O:
                pairs = [(Kind.F, "F", False), (Kind.P, "P to bring them back", True)]
            else:
                pairs = [(Kind.O, "O", False)]
            for kind, what, after in pairs:
                j = where.get((s, kind, mb))
                if j is None:
                    problems.append(f"{action} on device {device} has no {what}")
                    marked.append(action)
                elif (j < i) == after:
                    side = "after" if after else "before"
                    problems.append(f"{action} needs {Action(s, kind, mb)} listed {side} it "
                                    f"on device {device}")
                    marked += [action, Action(s, kind, mb)]
            if action.kind is Kind.P:
                for kind in (Kind.B, Kind.BW):
                    j = where.get((s, kind, mb))
                    if j is not None and j < i:
                        back = Action(s, kind, mb)
                        problems.append(f"{back} runs before its prefetch {action} on device "
                                        f"{device}: its activations are still in host memory")
                        marked += [back, action]
    return problems, marked


def _missing(kinds: list[Kind]) -> str:
    have = set(kinds)
    if not have:
        return "ops at all (needs F and B and W, or F and BW)"
    if Kind.F not in have:
        return "F"
    if Kind.BW in have:
        return "" if not have & {Kind.B, Kind.W} else "mix: it has BW and also B or W"
    if Kind.B not in have and Kind.W not in have:
        return "backward (B and W, or BW)"
    if Kind.W not in have:
        return "W for its B"
    if Kind.B not in have:
        return "B for its W"
    return ""


def _memory_problems(schedule: Schedule, result: SimResult, memory: MemoryModel,
                     limit: float) -> tuple[list[str], list[Action]]:
    problems, marked = [], []
    chunks = schedule.placement.chunks
    for device, intervals in enumerate(result.intervals):
        copies = result.copies[device] if result.copies else ()
        for level, action in memory_levels(intervals, copies, memory, chunks):
            if level > limit + 1e-9:
                peak = result.peak_memory[device]
                problems.append(f"device {device} peaks at {peak:g} > memory limit {limit:g} "
                                f"(first over after {action})")
                marked.append(action)
                break
    return problems, marked


def validate(schedule: Schedule, costs: Costs, memory: MemoryModel | None = None,
             memory_limit: float | None = None) -> SimResult:
    """Return the simulated result of a valid schedule; raise ScheduleError otherwise.

    `costs` are per stage of the schedule's placement; `memory_limit` bounds every device's peak.
    """
    memory = memory or MemoryModel()
    problems, marked = _placement_problems(schedule)
    if not problems:
        problems, marked = _completeness_problems(schedule)
        copy_problems, copy_marked = _copy_problems(schedule)
        problems, marked = problems + copy_problems, marked + copy_marked
    if problems:
        raise _fail(schedule, problems, marked)
    try:
        result = simulate(schedule, costs, memory)
    except ScheduleError as err:
        raise _fail(schedule, [str(err)], err.marked) from None
    if memory_limit is not None:
        problems, marked = _memory_problems(schedule, result, memory, memory_limit)
        if problems:
            raise _fail(schedule, problems, marked, over_memory=True)
    return result
