"""The schedules one model's backprop runs under, chosen per step: from the simulator's costs, or
from F/B/W times profiled once per model and stage count on executors that can measure (torch);
each built once for its inputs, offloading as the backprop's config says ([Note: offload in
flowkit/planner/offload.py]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flowkit.planner import Costs, MemoryModel, Schedule, ScheduleError
from flowkit.planner.lower import NodePlan
from flowkit.planner.offload import best_with_offload, offload_schedule
from flowkit.planner.schedules import build_schedule
from flowkit.planner.simcosts import SimCosts
from flowkit.runner.replicas import replica_counts
from flowkit.runner.stepstate import FlowRunError
from flowkit.runner.training_tasks import device_shares, model_spec, profile_stages
from flowkit.runtime.futures import RemoteError

__all__ = ["TrainingSchedules", "backprop_kind"]

# [Note: one device, one backward] On one device and one replica, no bubble exists for a
# separate W to fill and no all-reduce for it to start early: ZB-H1's and ZB-H2's B and W apart
# only cost their bookkeeping. The README's Qwen2 GRPO trained on one stage took 0.44 and
# 0.46 s a step under ZB-H1 against 0.41 and 0.40 under 1F1B (two alternating pairs of runs
# by a throwaway script before this change, `RunConfig(stages=1, replicas=1, schedule=...)`;
# no command reproduces them, since both now run 1F1B). Such a backprop runs 1F1B, its B and
# W one fused backward; the gradients are the same. The memory-limit check before a run
# (setup.py) checks the same schedule.
_SPLIT_ON_ONE_DEVICE = frozenset({"zb-h1", "zb-h2"})


class TrainingSchedules:
    """The schedules of `training`'s (a model_training.ModelTraining's) backprops, and the stage
    costs they were chosen by, kept across steps."""

    def __init__(self, training: Any) -> None:
        self.training = training
        self.schedules: dict[tuple, Any] = {}  # built schedules by their inputs

    def replicas(self, plan: NodePlan, kind: str, count: int,
                 sample: Callable[[], Any] | None) -> tuple[Costs, list[Schedule]]:
        """Each replica's schedule for its share of `count` microbatches (replica_counts)."""
        planned = [self._plan(plan, kind, share, sample)
                   for share in replica_counts(count, self.training.replicas)]
        return planned[0][0], [schedule for _, schedule in planned]

    def unprofiled(self, plan: NodePlan, kind: str, count: int) -> bool:
        """Whether planning `count` microbatches would profile the model first: on executors
        that measure, in a stage count it has no profile of yet."""
        return self._measures() and any(
            self._placement(plan, kind, share)[1] not in self.training.profiles
            for share in replica_counts(count, self.training.replicas))

    def _measures(self) -> bool:
        """Whether the costs are profiled: executors that measure, no simulator's costs."""
        training = self.training
        return training.sim_costs is None and all("profile_stage" in e.ops
                                                  for e in training.executors)

    def _placement(self, plan: NodePlan, kind: str, count: int) -> tuple[Any, tuple]:
        """(the placement, its profile's key) of the schedule for `count` microbatches."""
        limit, offload = plan.config.get("memory_limit"), plan.config.get("offload")
        probe = "auto" if offload == "auto" else None  # auto may fit only with offload
        placement = self.schedule(kind, self.training.devices, count,
                                  Costs.uniform(self.training.devices), limit, probe).placement
        return placement, (self.training.model.name, placement.num_stages)

    def _plan(self, plan: NodePlan, kind: str, count: int,
              sample: Callable[[], Any] | None) -> tuple[Costs, Any]:
        """The schedule for this step, from the simulator's costs or, on executors that can
        measure (torch), from F/B/W times profiled once per model and stage count (on no
        `sample`, uniform costs until a step has items to profile on)."""
        training = self.training
        limit, offload = plan.config.get("memory_limit"), plan.config.get("offload")
        devices = training.devices
        if not self._measures():
            costs = (training.sim_costs or SimCosts()).stage_costs(devices)
            schedule = self.schedule(kind, devices, count, costs, limit, offload)
            return costs.for_placement(schedule.placement), schedule
        placement, key = self._placement(plan, kind, count)
        if key not in training.profiles and sample is None:
            stage_costs = Costs.uniform(placement.num_stages)  # this step's only
            return stage_costs, self.schedule(kind, devices, count,
                                              device_shares(stage_costs, placement), limit,
                                              offload)
        if key not in training.profiles:
            try:
                training.profiles[key] = profile_stages(
                    training.ctl, training.replica(0), placement,
                    model_spec(training.model, placement.num_stages), sample(),
                    lane=training.lane_for(0), timeout=training.timeout,
                    reference=plan.reference)
            except RemoteError as exc:
                raise FlowRunError(f"step {training.step}: profiling model "
                                   f"{training.model.name!r} failed: {exc}") from exc
        stage_costs = training.profiles[key]
        schedule = self.schedule(kind, devices, count, device_shares(stage_costs, placement),
                                 limit, offload)
        return stage_costs, schedule

    def schedule(self, kind: str, devices: int, count: int, costs: Costs,
                 limit: float | None, offload: str | None = None) -> Any:
        """Built once per input: `auto` searches, which must not cost every step its time.
        `offload` ("half", "all"): with that share of its activations offloaded; "auto": none,
        half or all, whichever gives the least makespan within `limit`."""
        kind = backprop_kind(kind, devices, self.training.replicas)
        key = (kind, devices, count, costs, limit, offload)
        if key not in self.schedules:
            if offload == "auto":  # none, half or all: the least makespan within the limit
                return self._auto_offload(key, kind, devices, count, costs, limit)
            try:
                schedule = build_schedule(kind, devices=devices, microbatches=count,
                                          costs=costs, memory_limit=limit)
            except ScheduleError as exc:  # one line, not the grid of the schedule
                raise FlowRunError(f"step {self.training.step}: model "
                                   f"{self.training.model.name!r}: "
                                   f"{exc.problems[0]}: raise its memory_limit, or let "
                                   "offload make room (offload auto)") from None
            if offload not in (None, "none"):  # [Note: offload in flowkit/planner/offload.py]
                schedule = offload_schedule(schedule, costs.for_placement(schedule.placement),
                                            offload)
            self.schedules[key] = schedule
        return self.schedules[key]

    def _auto_offload(self, key: tuple, kind: str, devices: int, count: int, costs: Costs,
                      limit: float | None) -> Schedule:
        name = self.training.model.name
        if limit is None:
            raise FlowRunError(f"model {name!r}: offload auto chooses under a "
                               "memory limit, and its backprop has none: give it memory_limit")
        try:
            pick = best_with_offload(kind, devices=devices, microbatches=count, costs=costs,
                                     memory=MemoryModel(), memory_limit=limit)
        except ScheduleError as exc:
            raise FlowRunError(f"step {self.training.step}: model {name!r}: {exc}") from None
        self.schedules[key] = pick.schedule
        return pick.schedule


def backprop_kind(kind: str, devices: int, replicas: int) -> str:
    """The schedule kind a backprop runs: 1F1B for a split kind on one device and one replica
    [Note: one device, one backward], else `kind`."""
    if devices == 1 and replicas == 1 and kind in _SPLIT_ON_ONE_DEVICE:
        return "1f1b"
    return kind
