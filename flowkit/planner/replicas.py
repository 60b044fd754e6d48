"""Timing data parallel × pipeline parallel without devices: where each stage's gradient
all-reduce falls after a replica's schedule, and what of it the schedule hides.

The model is the runtime's [Note: replicas in flowkit/runner/replicas.py]: every replica runs
the same schedule (the slowest, with uneven microbatch counts, is the one given); each stage's
all-reduce is a task in its device's lane after the device's last action, so a device's
reductions start when its last action ends and run one after the other, in stage order, each
taking `allreduce_s` for its stage's share of the gradients. Devices that finish early reduce
while the others still compute: in 1F1B the last device's all-reduce hides behind the first
device's last backward passes. The optimizer step starts when the last all-reduce ends: the
step's time is the pipeline's makespan plus what no action hid.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from flowkit.planner.ir import Costs, Schedule
from flowkit.planner.simulate import SimResult, simulate

__all__ = ["Reduction", "ReplicatedResult", "simulate_replicas"]


@attrs.frozen
class Reduction:
    """One stage's all-reduce on its device: when its gradients were final (`ready`), when it
    ran."""

    stage: int
    device: int
    ready: float
    start: float
    end: float


@attrs.frozen(kw_only=True)
class ReplicatedResult:
    pipeline: SimResult  # one replica's schedule, as simulate() times it
    reductions: tuple[Reduction, ...]  # by stage
    step: float  # from the first action to the end of the last all-reduce
    first: float = 0.0  # when the first action started

    @property
    def allreduce(self) -> float:
        """The all-reduce's seconds on the device that spends the most on it."""
        per_device: dict[int, float] = {}
        for r in self.reductions:
            per_device[r.device] = per_device.get(r.device, 0.0) + (r.end - r.start)
        return max(per_device.values(), default=0.0)

    @property
    def exposed(self) -> float:
        """What the all-reduce adds to the step: seconds after the pipeline's last action."""
        return max(0.0, self.step - self.pipeline.makespan)

    @property
    def hidden(self) -> float:
        """The share of every device's all-reduce time that ran while some device still
        computed (before the pipeline's last action): 1 when none of it shows."""
        total = sum(r.end - r.start for r in self.reductions)
        if total <= 0:
            return 1.0
        end = self.first + self.pipeline.makespan
        return sum(max(0.0, min(r.end, end) - r.start) for r in self.reductions) / total

    def to_json(self) -> dict:
        return {"makespan": self.pipeline.makespan, "step": self.step,
                "allreduce": self.allreduce, "exposed": self.exposed, "hidden": self.hidden,
                "reductions": [attrs.asdict(r) for r in self.reductions]}


def simulate_replicas(schedule: Schedule, costs: Costs, allreduce_s: float | Sequence[float]
                      ) -> ReplicatedResult:
    """Time `schedule` (one replica's) with each stage's all-reduce after it; `allreduce_s` is
    the seconds of one stage's all-reduce, or one value per stage."""
    pipeline = simulate(schedule, costs)
    stages = schedule.num_stages
    seconds = [float(allreduce_s)] * stages if isinstance(allreduce_s, (int, float)) \
        else [float(s) for s in allreduce_s]
    if len(seconds) != stages:
        raise ValueError(f"allreduce_s needs one value or one per stage ({stages}), got "
                         f"{len(seconds)}")
    reductions = []
    for device, intervals in enumerate(pipeline.intervals):
        if not intervals:
            continue
        clock = intervals[-1].end  # the device's last action: its lane's reductions follow
        for stage in sorted({i.action.stage for i in intervals}):
            ready = max(i.end for i in intervals if i.action.stage == stage)
            reductions.append(Reduction(stage=stage, device=device, ready=ready, start=clock,
                                        end=clock + seconds[stage]))
            clock += seconds[stage]
    first = min((i.start for ops in pipeline.intervals for i in ops), default=0.0)
    last = max([pipeline.makespan + first] + [r.end for r in reductions])
    return ReplicatedResult(pipeline=pipeline, reductions=tuple(sorted(reductions,
                                                                       key=lambda r: r.stage)),
                            step=last - first, first=first)
