"""Timing data parallel × pipeline parallel without devices: where each stage's gradient
all-reduce falls after a replica's schedule, and what of it the schedule hides.

The model is the runtime's [Note: replicas in flowkit/runner/replicas.py]: every replica runs
the same schedule (the slowest, with uneven microbatch counts, is the one given); each stage's
all-reduce is a task in its device's lane after the device's last action, so a device's
reductions start when its last action ends and run one after the other, in the order it ended
its stages, each taking `allreduce_s` for its stage's share of the gradients. Devices that
finish early reduce while the others still compute: in 1F1B the last device's all-reduce hides
behind the first device's last backward passes. The optimizer step starts when the last
all-reduce ends: the step's time is the pipeline's makespan plus what no action hid.

With `overlap=True` the reduction starts inside the device's last weight-gradient op of each
stage instead [Note: overlapped all-reduce], as the torch executors run it (FSDP's
reduce-scatter too) [Note: all-reduce in the last W in executors/torch/train/replicas.py].
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from flowkit.planner.ir import Costs, Kind, Schedule
from flowkit.planner.simulate import Interval, SimResult, simulate

__all__ = ["GRAD_BUCKET_BYTES", "Reduction", "ReplicatedResult", "buckets_for",
           "simulate_replicas"]

# the runtime's bucket (executors/torch/train/replicas.py BUCKET_BYTES, torch DDP's default)
GRAD_BUCKET_BYTES = 25 << 20


def buckets_for(grad_bytes: float, bucket_bytes: float = GRAD_BUCKET_BYTES) -> int:
    """How many buckets a stage's `grad_bytes` of gradients are all-reduced in (at least 1)."""
    return max(1, -int(-grad_bytes // bucket_bytes))


@attrs.frozen
class Reduction:
    """One stage's all-reduce on its device: when its gradients were final (`ready`: its last
    bucket's), when it ran; `spans` are its buckets' times on the device's communication stream
    (one span, start to end, when not overlapped)."""

    stage: int
    device: int
    ready: float
    start: float
    end: float
    spans: tuple[tuple[float, float], ...] = attrs.field()

    @spans.default
    def _whole(self) -> tuple[tuple[float, float], ...]:
        return ((self.start, self.end),)

    @property
    def seconds(self) -> float:
        return sum(end - start for start, end in self.spans)

    def seconds_before(self, time: float) -> float:
        """Its communication seconds that ran before `time`."""
        return sum(max(0.0, min(end, time) - start) for start, end in self.spans)


@attrs.frozen(kw_only=True)
class ReplicatedResult:
    pipeline: SimResult  # one replica's schedule, as simulate() times it
    reductions: tuple[Reduction, ...]  # by stage
    step: float  # from the first action to the end of the last all-reduce
    first: float = 0.0  # when the first action started
    overlap: bool = False  # buckets reduced as they became final [Note: overlapped all-reduce]

    @property
    def allreduce(self) -> float:
        """The all-reduce's seconds on the device that spends the most on it."""
        per_device: dict[int, float] = {}
        for r in self.reductions:
            per_device[r.device] = per_device.get(r.device, 0.0) + r.seconds
        return max(per_device.values(), default=0.0)

    @property
    def exposed(self) -> float:
        """What the all-reduce adds to the step: seconds after the pipeline's last action."""
        return max(0.0, self.step - self.pipeline.makespan)

    @property
    def hidden(self) -> float:
        """The share of every device's all-reduce time that ran while some device still
        computed (before the pipeline's last action): 1 when none of it shows."""
        total = sum(r.seconds for r in self.reductions)
        if total <= 0:
            return 1.0
        end = self.first + self.pipeline.makespan
        return min(1.0, sum(r.seconds_before(end) for r in self.reductions) / total)

    def to_json(self) -> dict:
        return {"makespan": self.pipeline.makespan, "step": self.step, "overlap": self.overlap,
                "allreduce": self.allreduce, "exposed": self.exposed, "hidden": self.hidden,
                "reductions": [attrs.asdict(r) for r in self.reductions]}


def _per_stage(value: float | Sequence[float], stages: int, name: str, cast: type) -> list:
    values = [cast(value)] * stages if isinstance(value, (int, float)) \
        else [cast(v) for v in value]
    if len(values) != stages:
        raise ValueError(f"{name} needs one value or one per stage ({stages}), got "
                         f"{len(values)}")
    return values


def simulate_replicas(schedule: Schedule, costs: Costs, allreduce_s: float | Sequence[float],
                      *, overlap: bool = False, buckets: int | Sequence[int] = 1
                      ) -> ReplicatedResult:
    """Time `schedule` (one replica's) with each stage's all-reduce; `allreduce_s` is the
    seconds of one stage's all-reduce, or one value per stage. overlap=False: after the
    device's last action (today's runtime); True: in `buckets` (per stage, or one count for
    all) started as the device's last W (or BW) of the stage makes them final."""
    pipeline = simulate(schedule, costs)
    stages = schedule.num_stages
    seconds = _per_stage(allreduce_s, stages, "allreduce_s", float)
    counts = _per_stage(buckets, stages, "buckets", int)
    if min(counts) < 1:
        raise ValueError(f"buckets must be >= 1 a stage, got {counts}")
    reductions = []
    for device, intervals in enumerate(pipeline.intervals):
        if intervals:
            reduce = _overlapped if overlap else _after_last_action
            reductions.extend(reduce(device, intervals, seconds, counts))
    first = min((i.start for ops in pipeline.intervals for i in ops), default=0.0)
    last = max([pipeline.makespan + first] + [r.end for r in reductions])
    return ReplicatedResult(pipeline=pipeline, reductions=tuple(sorted(reductions,
                                                                       key=lambda r: r.stage)),
                            step=last - first, first=first, overlap=overlap)


def _stages_on(intervals: Sequence[Interval]) -> list[int]:
    return sorted({i.action.stage for i in intervals})


def _after_last_action(device: int, intervals: Sequence[Interval], seconds: list[float],
                       _counts: list[int]) -> list[Reduction]:
    """The device's lane reduces its stages after its last action, in the order it ended
    them (the runtime's reduce_grads order: flowkit/runner/training_tasks.py)."""
    clock = intervals[-1].end
    reductions = []
    ends = {stage: max(i.end for i in intervals if i.action.stage == stage)
            for stage in _stages_on(intervals)}
    for stage in sorted(ends, key=lambda s: (ends[s], s)):
        ready = ends[stage]
        reductions.append(Reduction(stage=stage, device=device, ready=ready, start=clock,
                                    end=clock + seconds[stage]))
        clock += seconds[stage]
    return reductions


def _last_gradient_op(intervals: Sequence[Interval], stage: int) -> Interval:
    """The op that makes the stage's weight gradients final: its last W or BW (a B only
    where neither runs, which no schedule builds)."""
    ops = [i for i in intervals if i.action.stage == stage]
    weight = [i for i in ops if i.action.kind in (Kind.W, Kind.BW)]
    return max(weight or [i for i in ops if i.action.kind is Kind.B] or ops,
               key=lambda i: i.end)


def _overlapped(device: int, intervals: Sequence[Interval], seconds: list[float],
                counts: list[int]) -> list[Reduction]:
    """[Note: overlapped all-reduce] A stage's gradients become final bucket by bucket during
    its device's last W (or BW) of the stage: that op's time splits evenly into the stage's
    buckets (backward order: the last layers' first), each bucket's all-reduce (an even share
    of the stage's seconds) may start when its part of the op ends, and one communication
    stream a device runs them one at a time, in the order they became ready. No bucket is
    ready after the device's last action, so a device never ends later than reducing after it.
    A 1B model, P = 4, D = 8, hidden at 25 / 100 Gb/s: ZB-H1 0 / 0 % -> 4 / 14 %, 1F1B
    11 / 44 % -> 18 / 68 % (`flowkit bench train --allreduce-overlap`): one W hides little."""
    queue = []  # (ready, stage, seconds) per bucket
    for stage in _stages_on(intervals):
        op = _last_gradient_op(intervals, stage)
        n = counts[stage]
        queue += [(op.start + (k + 1) * (op.end - op.start) / n, stage, seconds[stage] / n)
                  for k in range(n)]
    spans: dict[int, list[tuple[float, float]]] = {}
    readies: dict[int, float] = {}
    clock = float("-inf")
    for ready, stage, length in sorted(queue):
        start = max(clock, ready)
        clock = start + length
        spans.setdefault(stage, []).append((start, clock))
        readies[stage] = ready
    return [Reduction(stage=stage, device=device, ready=readies[stage], start=s[0][0],
                      end=s[-1][1], spans=tuple(s)) for stage, s in spans.items()]
