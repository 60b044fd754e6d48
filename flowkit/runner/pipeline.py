"""Run a pipeline schedule from the planner on executors: one task per action.

Each device's actions go to one executor in one lane, so they run in the schedule's order
[Note: lanes]; dependencies between stages are objects: F of stage s reads the activation F of
stage s-1 made, B of stage s reads the gradient B of stage s+1 made (the last stage's B reads its
own F's output), W reads its B's output, which sits on the same executor and never moves. Every
task is submitted before the first one finishes: the control plane runs ahead of the data.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Protocol

import attrs

from flowkit.planner import (
    Action,
    ActionKey,
    Costs,
    Kind,
    MemoryModel,
    Schedule,
    action_key,
    bubble_rate,
)
from flowkit.planner.simulate import dependencies
from flowkit.runtime.controller import Controller
from flowkit.runtime.futures import Future, wait
from flowkit.runtime.registry import ExecutorInfo

__all__ = ["Gate", "Lane", "PipelineRun", "StreamedSchedule", "device_lane", "measure",
           "stage_costs_config", "submit_schedule"]

ConfigFor = Callable[[Action], dict]
# a model's lanes: a prefix that each device's lane adds '/device' to, or each device's lane
# (a model whose pipeline is fused with another's runs in lanes the models share [Note: fused
# training in flowkit/runner/fusedtrain.py])
Lane = str | Callable[[int], str]


def device_lane(lane: Lane, device: int) -> str:
    """The lane of a model's device `device`."""
    return lane(device) if callable(lane) else f"{lane}/{device}"


class Gate(Protocol):
    """Says which action a device may submit next, where several schedules share the device's
    lane and its order is theirs together [Note: fused training]."""

    def allows(self, device: int, action: Action) -> bool: ...

    def taken(self, device: int, action: Action) -> None: ...


@attrs.define
class PipelineRun:
    """The futures of a submitted schedule; `timings()` once they are done."""

    schedule: Schedule
    futures: dict[Action, Future]
    losses: list[Future]  # per microbatch: the last stage's forward output

    def wait(self, timeout: float | None = None) -> None:
        """Block until every action is done; raise the first failure."""
        done, pending = wait(self.futures.values(), timeout=timeout)
        if pending:
            raise TimeoutError(f"{len(pending)} of {len(self.futures)} pipeline actions were "
                               f"not done after {timeout} s")
        for action in sorted(self.futures, key=str):
            error = self.futures[action].exception()
            if error is not None:
                raise error

    def measured(self) -> dict:
        """Makespan, per-device span and busy time, and the bubble rate, from the executors'
        own start and end times (`measure`)."""
        placement = self.schedule.placement
        return measure((placement.device_of(action.stage), future.timing)
                       for action, future in self.futures.items())


def measure(timings: Iterable[tuple[Hashable, tuple[float, float]]]) -> dict:
    """Makespan, per-device span and busy time, and the bubble rate as the planner defines it
    (flowkit.planner.bubble_rate) of ops given as (device, (start, end))."""
    by_device: dict[Hashable, list[tuple[float, float]]] = defaultdict(list)
    for device, timing in timings:
        by_device[device].append(timing)
    windows = [by_device[d] for d in sorted(by_device)]
    span = [max(e for _, e in w) - min(s for s, _ in w) for w in windows]
    busy = [sum(e - s for s, e in w) for w in windows]
    first = min(s for w in windows for s, _ in w)
    last = max(e for w in windows for _, e in w)
    return {"makespan": last - first, "device_span": span, "busy": busy,
            "bubble_rate": bubble_rate(span, busy)}


class _Cursor:
    """Where each device's action list has been submitted up to. `advance(take)` moves every
    device on while its next action's dependencies are submitted and `take(device, action)`
    accepts it (a streamed pipeline refuses an F whose microbatch has not formed yet)."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.position = [0] * schedule.num_devices
        self.submitted: set[ActionKey] = set()

    @property
    def done(self) -> bool:
        return all(p == len(ops) for p, ops in zip(self.position, self.schedule.device_ops))

    def advance(self, take: Callable[[int, Action], bool]) -> None:
        stages = self.schedule.num_stages
        progress = True
        while progress:
            progress = False
            for device, ops in enumerate(self.schedule.device_ops):
                while self.position[device] < len(ops):
                    action = ops[self.position[device]]
                    if not all(action_key(*dep) in self.submitted
                               for dep in dependencies(action, stages)):
                        break
                    if not take(device, action):
                        break
                    self.submitted.add(action.key)
                    self.position[device] += 1
                    progress = True


class StreamedSchedule:
    """A schedule submitted as its microbatches form: `feed(mb, inputs)` gives microbatch mb its
    inputs, `advance()` submits every action whose dependencies and inputs exist, each device's
    actions in the schedule's order. Only the forwards of stage 0 and the last stage read a
    microbatch's inputs, so the rest of the schedule never waits for data it does not read.
    With a `gate`, a device submits only the action the gate allows next."""

    def __init__(self, ctl: Controller, schedule: Schedule, executors: Sequence[ExecutorInfo],
                 *, config_for: ConfigFor | None = None, lane: Lane = "pipeline",
                 meta: dict | None = None,
                 on_submit: Callable[[Action, Future], None] | None = None,
                 gate: Gate | None = None) -> None:
        if len(executors) != schedule.num_devices:
            raise ValueError(f"schedule {schedule.kind!r} needs {schedule.num_devices} "
                             f"executors, got {len(executors)}")
        self.ctl, self.executors = ctl, executors
        self.config_for, self.lane, self.meta = config_for, lane, meta or {}
        self.on_submit, self.gate = on_submit, gate
        self.run = PipelineRun(schedule=schedule, futures={}, losses=[])
        self.inputs: dict[int, Any] = {}
        self._cursor = _Cursor(schedule)
        self._outputs: dict[ActionKey, Future] = {}
        # (stage, microbatch) whose backward is one BW: its forward need not split it
        # [Note: a fused backward in executors/torch/train/stage.py]
        self._fused = {(a.stage, a.microbatch) for ops in schedule.device_ops for a in ops
                       if a.kind is Kind.BW}
        # the copies each compute op issues as it starts [Note: offload in the runtime]
        self._copies = _carried_copies(schedule, config_for)

    @property
    def done(self) -> bool:
        """Every action is submitted."""
        return self._cursor.done

    def feed(self, microbatch: int, inputs: Any) -> None:
        """Microbatch `microbatch`'s inputs: a ref or value, or a tuple of them."""
        self.inputs[microbatch] = inputs

    def advance(self) -> None:
        with self.ctl.batch():
            self._cursor.advance(self._submit)
        if self.done and not self.run.losses:
            schedule = self.run.schedule
            last = schedule.num_stages - 1
            self.run.losses = [self.run.futures[Action(last, Kind.F, mb)]
                               for mb in range(schedule.microbatches)]

    def _submit(self, device: int, action: Action) -> bool:
        if self.gate is not None and not self.gate.allows(device, action):
            return False
        sent = self._send(device, action)
        if sent and self.gate is not None:
            self.gate.taken(device, action)
        return sent

    def _send(self, device: int, action: Action) -> bool:
        if action.kind.is_copy:  # no task: its compute op carries it
            return True
        last = self.run.schedule.num_stages - 1
        reads_data = action.kind is Kind.F and action.stage in (0, last)
        if reads_data and action.microbatch not in self.inputs:
            return False
        inputs = _inputs_of(action, self._outputs, last, self.inputs)
        meta = {**self.meta, "stage": action.stage, "microbatch": action.microbatch,
                "device": device, "action": str(action)}
        config = dict(self.config_for(action)) if self.config_for else {}
        if action.kind is Kind.F and (action.stage, action.microbatch) in self._fused:
            config["fused_backward"] = True
        if self._copies:  # a backward finds its microbatch's copies by them
            config.setdefault("stage", action.stage)
            config.setdefault("microbatch", action.microbatch)
            config.update(self._copies.get(action, {}))
        future = self.ctl.submit(action.kind.value, *inputs, config=config,
                                 executor=self.executors[device].id,
                                 lane=device_lane(self.lane, device), meta=meta)
        self._outputs[action.key] = future
        self.run.futures[action] = future
        if self.on_submit is not None:
            self.on_submit(action, future)
        return True


def submit_schedule(ctl: Controller, schedule: Schedule, executors: Sequence[ExecutorInfo], *,
                    microbatch_inputs: Sequence[Any] | None = None,
                    config_for: ConfigFor | None = None, lane: str = "pipeline",
                    meta: dict | None = None) -> PipelineRun:
    """Submit every action of `schedule`, device d on `executors[d]`. `microbatch_inputs[mb]`
    (a future, Item, Gather or value; a tuple of them for several inputs) feeds the forward of
    microbatch mb on stage 0 and, after its activation, on the last stage (the targets);
    `config_for` gives each action's op config."""
    streamed = StreamedSchedule(ctl, schedule, executors, config_for=config_for, lane=lane,
                                meta=meta)
    for mb in range(schedule.microbatches):
        streamed.feed(mb, microbatch_inputs[mb] if microbatch_inputs is not None else ())
    streamed.advance()
    if not streamed.done:
        raise ValueError(f"schedule {schedule.kind!r} deadlocks: validate it with the planner")
    return streamed.run


# [Note: offload in the runtime in flowkit/ops/executor_ops.py] An O is issued with its F and
# waits for it, so the F carries it (`offload`); a P is issued as the compute op listed before
# it starts, so that op carries it (`prefetch`), whichever stage or microbatch it is of.
def _carried_copies(schedule: Schedule, config_for: ConfigFor | None) -> dict[Action, dict]:
    """The offload keys of each compute op that issues copies: an F whose O follows it gets
    `offload` and its copy's `copy_seconds`, the compute op before a P gets [stage,
    microbatch, copy seconds] in its `prefetch` list. A copy's seconds are its config's."""
    def seconds(copy: Action) -> float:
        return float((config_for(copy) if config_for else {}).get("seconds", 0.0))

    carried: dict[Action, dict] = {}
    for device, ops in enumerate(schedule.device_ops):
        carrier: Action | None = None
        for action in ops:
            if not action.kind.is_copy:
                carrier = action
                continue
            if carrier is None:
                raise ValueError(f"schedule {schedule.kind!r}: {action} on device {device} "
                                 "comes before any compute op that could issue it")
            keys = carried.setdefault(carrier, {})
            if action.kind is Kind.O:
                if carrier != Action(action.stage, Kind.F, action.microbatch):
                    raise ValueError(f"schedule {schedule.kind!r}: {action} on device "
                                     f"{device} does not follow its forward")
                keys.update(offload=True, copy_seconds=seconds(action))
            else:
                keys.setdefault("prefetch", []).append(
                    [action.stage, action.microbatch, seconds(action)])
    return carried


def _inputs_of(action: Action, outputs: dict, last: int, microbatch_inputs: dict) -> list:
    """Stage 0's F reads the microbatch; the last stage's F reads it too (its targets), after
    the activation; every other action reads what its dependencies made."""
    given: list = []
    if action.kind is Kind.F and action.stage in (0, last):
        value = microbatch_inputs[action.microbatch]
        given = list(value) if isinstance(value, tuple) else [value]  # a tuple: several inputs
    if action.kind is Kind.F and action.stage == 0:
        return given
    return [outputs[action_key(*dep)] for dep in dependencies(action, last + 1)] + given


def stage_costs_config(costs: Costs, *, activation_bytes: int = 0,
                       memory: MemoryModel | None = None, chunks: int = 1) -> ConfigFor:
    """Op configs for the simulator executor: each action's cost in seconds and its output size,
    and with `memory` what it adds to its device's activation memory (`MemoryModel.delta` of a
    placement with `chunks` stages a device), which the simulator accounts."""
    last = costs.num_stages - 1

    def config_for(action: Action) -> dict:
        config = {"seconds": costs.of(action)}  # a copy's: its copy engine's time
        if memory is not None and not action.kind.is_copy:
            config["memory"] = memory.delta(action, chunks)
        if action.kind is Kind.F:
            config.update(out_bytes=activation_bytes, last=action.stage == last)
        elif action.kind in (Kind.B, Kind.BW):
            config.update(out_bytes=activation_bytes, first=action.stage == 0)
        return config

    return config_for
