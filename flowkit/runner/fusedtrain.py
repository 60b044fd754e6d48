"""Several models' backprops run as one fused schedule on the executors they share.

[Note: fused training] Backprops that name the same `fuse` group (PPO's actor and critic) train
under one schedule a step: the planner's `fuse` interleaves their schedules on the executors
they share [Note: fused schedules in flowkit/planner/fused.py], and each shared executor runs
the group's actions in one lane, in the fused order. Each model's own schedule is built as
without fusion; each member submits its actions through a gate that lets a device's next action
go only when it is the fused list's next there, and every member's feed advances all of them.
The fused schedule is planned once every member has its schedule in the step; a member's
optimizer step, exports, reports and profiling run in the same shared lanes. Placement: the
first model as any model; every other on the same executors, its stages the other way round
(stage s on the first model's stage P-1-s: RLHFuse's layout, one pipeline's warm-up in the
other's cool-down, `flowrun.FlowRunner._place_models`); stages on distinct executors, one
replica. In full: docs/schedules.md, "Fusing two models' pipelines", and docs/rl.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from flowkit.ops import rounds_of
from flowkit.planner import Action, Costs, Schedule, ScheduleError
from flowkit.planner.fused import FusedSchedule, fuse, fused_report
from flowkit.planner.lower import Call, NodePlan
from flowkit.runner.stepstate import FlowRunError

if TYPE_CHECKING:
    from flowkit.runner.model_training import ModelTraining

__all__ = ["FusedTraining", "fuse_groups"]

# the local search's bound on planning a group's schedule (once per step shape): the
# controller's time, which a step waits for
_SEARCH_SECONDS = 0.5


def fuse_groups(plan: Sequence[NodePlan]) -> dict[str, list[str]]:
    """The models of each fuse group, in the plan's order, from their backprops' `fuse`;
    refuses what fusing cannot run, before anything starts."""
    groups: dict[str, list[str]] = {}
    for node in plan:
        group = node.config.get("fuse") if node.call is Call.PIPELINE else None
        if group is None:
            continue
        names = groups.setdefault(group, [])
        if node.model.name in names:
            raise FlowRunError(f"{node.name!r}: model {node.model.name!r} has two backprops "
                               f"in fuse group {group!r}; fuse one backprop a model")
        if rounds_of(node.config) > 1:
            raise FlowRunError(f"{node.name!r} trains in minibatch rounds (epochs x "
                               f"minibatches > 1) and is fused (group {group!r}): fused "
                               "backprops train the step's batch in one round; drop one")
        names.append(node.model.name)
    return groups


class FusedTraining:
    """The fused backprops of `members` (group `group`), one step at a time."""

    def __init__(self, group: str, members: Sequence[ModelTraining]) -> None:
        names = [m.model.name for m in members]
        if len(members) < 2:
            raise FlowRunError(f"fuse group {group!r} has one model ({names[0]!r}): fusing "
                               "needs the backprops of two or more models")
        shared: dict[str, int] = {}
        for member in members:
            if member.replicas > 1:
                raise FlowRunError(
                    f"model {member.model.name!r} trains as {member.replicas} replicas and its "
                    f"backprop is fused (group {group!r}): fused models train as one replica "
                    "each; drop the fuse group or the replicas")
            ids = [e.id for e in member.replica(0)]
            if len(set(ids)) != len(ids):
                raise FlowRunError(
                    f"model {member.model.name!r} has {len(ids)} stages on {len(set(ids))} "
                    f"executors and its backprop is fused (group {group!r}): each stage of a "
                    f"fused model needs an executor of its own; start {len(ids)} executors "
                    "(flowkit run --num-executors)")
            for executor in ids:
                shared.setdefault(executor, len(shared))
        self.group, self.names, self.members = group, names, list(members)
        self.lane = "+".join(names)
        # devices[m][d]: the shared device (executor) of member m's device d
        self.devices = [[shared[e.id] for e in member.replica(0)] for member in members]
        # the plan and its predicted figures, by the members' schedules, costs and limit
        self.plans: dict[Any, tuple[FusedSchedule, dict[str, float]]] = {}
        # what plans the fused schedule: the planner's search; a benchmark's baseline puts the
        # models one after the other (flowkit.planner.fused.sequential) instead
        self.plan_with: Callable[..., FusedSchedule] = fuse
        self.predicted: dict[str, float] = {}
        for index, member in enumerate(members):
            member.join_fusion(self, index)
        self.step: int | None = None
        self.start_step(0)

    def lanes(self, index: int) -> Callable[[int], str]:
        """Member `index`'s lane of each of its devices: the shared device's."""
        devices = self.devices[index]
        return lambda device: f"{self.lane}/{devices[device]}"

    def start_step(self, step: int) -> None:
        """Each member says so as its step starts; the first resets the group."""
        if step == self.step:
            return
        self.step = step
        self.planned: dict[int, tuple[Schedule, Costs, float | None, Any, str]] = {}
        self.fused: FusedSchedule | None = None
        self.position = [0] * (1 + max(max(d) for d in self.devices))

    def gate(self, index: int) -> _Gate:
        return _Gate(self, index)

    def planned_member(self, index: int, node: str, schedule: Schedule, costs: Costs,
                       limit: float | None, submitter: Any) -> None:
        """Member `index`'s backprop `node` has its schedule (per-stage `costs`) and its
        submitter; once every member has, the fused schedule is planned, and each member's
        predicted bubble is the fused schedule's."""
        self.planned[index] = (schedule, costs, limit, submitter, node)
        if len(self.planned) < len(self.members):
            return
        schedules = [self.planned[i][0] for i in range(len(self.members))]
        costs = [self.planned[i][1] for i in range(len(self.members))]
        limits = [p[2] for p in self.planned.values() if p[2] is not None]
        limit = min(limits) if limits else None
        key = (tuple(schedules), tuple(costs), limit)
        if key not in self.plans:
            try:
                fused = self.plan_with(schedules, costs, devices=self.devices,
                                       memory_limit=limit, names=self.names,
                                       seconds=_SEARCH_SECONDS)
            except ScheduleError as exc:
                raise FlowRunError(f"fuse group {self.group!r}: {exc}") from None
            report = fused_report(fused, costs)
            self.plans[key] = (fused, {"bubble_rate": report["fused"]["bubble_rate"],
                                       "makespan": report["fused"]["makespan"],
                                       "separate_makespan": report["sum_makespan"]})
        self.fused, self.predicted = self.plans[key]
        for index, member in enumerate(self.members):
            member.predicted_bubble[self.planned[index][4]] = self.predicted["bubble_rate"]

    def advance(self) -> None:
        """Submit what the fused order lets every member submit, until none can go on."""
        if self.fused is None:
            return
        while True:
            before = sum(self.position)
            for index in range(len(self.members)):
                self.planned[index][3].advance()
            if sum(self.position) == before:
                return

    def _allows(self, index: int, device: int, action: Action) -> bool:
        if self.fused is None:
            return False
        shared = self.devices[index][device]
        ops = self.fused.device_ops[shared]
        at = self.position[shared]
        return at < len(ops) and ops[at] == (index, action)

    def _taken(self, index: int, device: int) -> None:
        self.position[self.devices[index][device]] += 1


class _Gate:
    """Member `index`'s view of the fused order (flowkit.runner.pipeline.Gate)."""

    def __init__(self, fusion: FusedTraining, index: int) -> None:
        self.fusion, self.index = fusion, index

    def allows(self, device: int, action: Action) -> bool:
        return self.fusion._allows(self.index, device, action)

    def taken(self, device: int, action: Action) -> None:
        self.fusion._taken(self.index, device)
