"""Run a pipeline schedule from the planner on executors: one task per action.

Each device's actions go to one executor in one lane, so they run in the schedule's order
[Note: lanes]; dependencies between stages are objects: F of stage s reads the activation F of
stage s-1 made, B of stage s reads the gradient B of stage s+1 made (the last stage's B reads its
own F's output), W reads its B's output, which sits on the same executor and never moves. Every
task is submitted before the first one finishes: the control plane runs ahead of the data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from flowkit.planner import Action, Costs, Kind, Schedule
from flowkit.planner.simulate import dependencies
from flowkit.runtime.controller import Controller
from flowkit.runtime.futures import Future, wait
from flowkit.runtime.records import ExecutorInfo

__all__ = ["PipelineRun", "StreamedSchedule", "submit_schedule", "submission_order"]

ConfigFor = Callable[[Action], dict]


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
        """Makespan, per-device span and busy time, and the bubble rate as the planner defines
        it (flowkit/planner/simulate.py), from the executors' own start and end times."""
        by_device: dict[int, list[tuple[float, float]]] = {}
        for action, future in self.futures.items():
            device = self.schedule.placement.device_of(action.stage)
            by_device.setdefault(device, []).append(future.timing)
        first = min(s for spans in by_device.values() for s, _ in spans)
        last = max(e for spans in by_device.values() for _, e in spans)
        span = [max(e for _, e in by_device[d]) - min(s for s, _ in by_device[d])
                for d in sorted(by_device)]
        busy = [sum(e - s for s, e in by_device[d]) for d in sorted(by_device)]
        bubble = (max(span) - max(busy)) / max(span) if max(span) > 0 else 0.0
        return {"makespan": last - first, "device_span": span, "busy": busy,
                "bubble_rate": bubble}


def submission_order(schedule: Schedule) -> list[tuple[int, Action]]:
    """(device, action) in an order that keeps each device's order and submits every action
    after the actions it reads from, so their futures exist when it is submitted."""
    order: list[tuple[int, Action]] = []
    cursor = _Cursor(schedule)
    cursor.advance(lambda device, action: order.append((device, action)) or True)
    if not cursor.done:
        raise ValueError(f"schedule {schedule.kind!r} deadlocks: validate it with the planner")
    return order


class _Cursor:
    """Where each device's action list has been submitted up to. `advance(take)` moves every
    device on while its next action's dependencies are submitted and `take(device, action)`
    accepts it (a streamed pipeline refuses an F whose microbatch has not formed yet)."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.position = [0] * schedule.num_devices
        self.submitted: set[tuple[int, str, int]] = set()

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
                    if not all(_dep_key(dep) in self.submitted
                               for dep in dependencies(action, stages)):
                        break
                    if not take(device, action):
                        break
                    self.submitted.add(_key(action))
                    self.position[device] += 1
                    progress = True


class StreamedSchedule:
    """A schedule submitted as its microbatches form: `feed(mb, inputs)` gives microbatch mb its
    inputs, `advance()` submits every action whose dependencies and inputs exist, each device's
    actions in the schedule's order. Only the forwards of stage 0 and the last stage read a
    microbatch's inputs, so the rest of the schedule never waits for data it does not read."""

    def __init__(self, ctl: Controller, schedule: Schedule, executors: Sequence[ExecutorInfo],
                 *, config_for: ConfigFor | None = None, lane: str = "pipeline",
                 meta: dict | None = None,
                 on_submit: Callable[[Action, Future], None] | None = None) -> None:
        if len(executors) != schedule.num_devices:
            raise ValueError(f"schedule {schedule.kind!r} needs {schedule.num_devices} "
                             f"executors, got {len(executors)}")
        self.ctl, self.executors = ctl, executors
        self.config_for, self.lane, self.meta = config_for, lane, meta or {}
        self.on_submit = on_submit
        self.run = PipelineRun(schedule=schedule, futures={}, losses=[])
        self.inputs: dict[int, Any] = {}
        self._cursor = _Cursor(schedule)
        self._outputs: dict[tuple[int, str, int], Future] = {}

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
        last = self.run.schedule.num_stages - 1
        reads_data = action.kind is Kind.F and action.stage in (0, last)
        if reads_data and action.microbatch not in self.inputs:
            return False
        inputs = _inputs_of(action, self._outputs, last, self.inputs)
        meta = {**self.meta, "stage": action.stage, "microbatch": action.microbatch,
                "device": device, "action": str(action)}
        config = dict(self.config_for(action)) if self.config_for else {}
        future = self.ctl.submit(action.kind.value, *inputs, config=config,
                                 executor=self.executors[device].id,
                                 lane=f"{self.lane}/{device}", meta=meta)
        self._outputs[_key(action)] = future
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


def _inputs_of(action: Action, outputs: dict, last: int, microbatch_inputs: dict) -> list:
    """Stage 0's F reads the microbatch; the last stage's F reads it too (its targets), after
    the activation; every other action reads what its dependencies made."""
    given: list = []
    if action.kind is Kind.F and action.stage in (0, last):
        value = microbatch_inputs[action.microbatch]
        given = list(value) if isinstance(value, tuple) else [value]  # a tuple: several inputs
    if action.kind is Kind.F and action.stage == 0:
        return given
    return [outputs[_dep_key(dep)] for dep in dependencies(action, last + 1)] + given


def _key(action: Action) -> tuple[int, str, int]:
    # B and BW share a key: whichever a stage uses is "the backward" its dependents read
    kind = "B" if action.kind in (Kind.B, Kind.BW) else action.kind.value
    return (action.stage, kind, action.microbatch)


def _dep_key(dep: tuple[int, Kind | None, int]) -> tuple[int, str, int]:
    stage, kind, mb = dep
    return (stage, "B" if kind is None else kind.value, mb)


def stage_costs_config(costs: Costs, *, activation_bytes: int = 0) -> ConfigFor:
    """Op configs for the simulator executor: each action's cost in seconds and its output size."""
    last = costs.num_stages - 1

    def config_for(action: Action) -> dict:
        config = {"seconds": costs.of(action)}
        if action.kind is Kind.F:
            config.update(out_bytes=activation_bytes, last=action.stage == last)
        elif action.kind in (Kind.B, Kind.BW):
            config.update(out_bytes=activation_bytes, first=action.stage == 0)
        return config

    return config_for


def execute_on_simulators(schedule: Schedule, stage_costs: Costs, *, unit_s: float = 0.001,
                          repeats: int = 3, activation_bytes: int = 1 << 16) -> dict:
    """Run `schedule` on one simulator executor per device, costs in units of `unit_s`
    seconds: the median of `repeats` runs after a warm-up, against the planner's simulation.

    The simulation's costs are profiled in the same run, as the Zero Bubble paper profiles
    T_F, T_B, T_W and T_comm: each op's cost gains the executors' own per-op time (one op's
    start to the next's on a busy executor, less the op's nominal time, with every executor
    busy at once as in the run), and the communication cost is the median time an activation
    takes from the end of the op that made it to the start of the op that reads it on another
    executor that has been waiting for it (an idle executor wakes more slowly than a busy one). With them, measured against simulated says whether the schedule's order costs
    anything the simulator does not know of.
    """
    from flowkit.planner import simulate
    from flowkit.runtime.launch import LocalExecutors

    seconds = _in_seconds(stage_costs, unit_s)
    config_for = stage_costs_config(seconds, activation_bytes=activation_bytes)
    with Controller() as ctl:
        executors = LocalExecutors(ctl, schedule.num_devices, kind="sim", name_prefix="sim")
        infos = sorted(executors.start(), key=lambda e: int(e.name.rsplit("-", 1)[1]))
        try:
            hop_s = (profile_hop(ctl, infos, activation_bytes, hops=50, op_s=unit_s)
                     if len(infos) > 1 else 0.0)
            op_overhead_s = profile_op_overhead(ctl, infos, unit_s)
            runs = []
            for _ in range(repeats + 1):  # the first run warms up sockets and caches
                run = submit_schedule(ctl, schedule, infos, config_for=config_for)
                run.wait(timeout=60 + 10 * simulate(schedule, seconds).makespan)
                runs.append(run.measured())
        finally:
            ctl.shutdown()
            executors.stop()
    median = sorted(runs[1:], key=lambda m: m["makespan"])[len(runs[1:]) // 2]
    nominal = simulate(schedule, seconds)
    profiled = simulate(schedule, attrs.evolve(seconds, comm=seconds.comm + hop_s,
                                               per_op=op_overhead_s))
    return {"kind": schedule.kind, "devices": schedule.num_devices,
            "microbatches": schedule.microbatches, "unit_s": unit_s, "hop_s": hop_s,
            "op_overhead_s": op_overhead_s,
            "measured_makespan_s": median["makespan"],
            "simulated_makespan_s": profiled.makespan,
            "nominal_makespan_s": nominal.makespan,
            "measured_bubble_rate": median["bubble_rate"],
            "simulated_bubble_rate": profiled.bubble_rate,
            "nominal_bubble_rate": nominal.bubble_rate,
            "makespan_ratio": median["makespan"] / profiled.makespan}


def profile_hop(ctl: Controller, executors: Sequence[ExecutorInfo], nbytes: int,
                hops: int = 100, op_s: float = 0.0) -> float:
    """Median seconds from one executor's op end to the next executor's op start when the
    second reads the first's `nbytes` output: the per-hop cost of a pipeline dependency.
    Each op of the chain takes `op_s`, so the reader has been idle that long when the data
    comes, as a pipeline stage waiting for its input has."""
    value = ctl.put(_zeros(nbytes), executor=executors[0].id)
    chain = []
    for i in range(hops + 1):
        value = ctl.submit("identity", value, config={"seconds": op_s},
                           executor=executors[(i + 1) % 2].id)
        chain.append(value)
    chain[-1].result(timeout=60)
    wait(chain, timeout=60)
    gaps = sorted(b.timing[0] - a.timing[1] for a, b in zip(chain, chain[1:]))
    return max(0.0, gaps[len(gaps) // 2])


def profile_op_overhead(ctl: Controller, executors: Sequence[ExecutorInfo], op_s: float,
                        ops: int = 40) -> float:
    """Median seconds an executor adds to each op of about `op_s` seconds: a chain of `ops`
    simulator forwards in one lane on every executor at once, one op's start to the next's,
    less `op_s`. Taken with all executors busy, it includes their contention for the cores."""
    with ctl.batch():
        chains = [[ctl.submit("F", config={"seconds": op_s}, executor=info.id,
                              lane=f"profile-{info.id}") for _ in range(ops)]
                  for info in executors]
    wait([f for chain in chains for f in chain], timeout=60 + 2 * ops * op_s)
    steps = sorted(b.timing[0] - a.timing[0] - op_s
                   for chain in chains for a, b in zip(chain[ops // 4:], chain[ops // 4 + 1:]))
    return max(0.0, steps[len(steps) // 2])


def _zeros(nbytes: int) -> Any:
    import torch

    return torch.zeros(nbytes, dtype=torch.uint8)


def _in_seconds(costs: Costs, unit_s: float) -> Costs:
    return Costs(F=[c * unit_s for c in costs.F], B=[c * unit_s for c in costs.B],
                 W=[c * unit_s for c in costs.W], comm=costs.comm * unit_s)
