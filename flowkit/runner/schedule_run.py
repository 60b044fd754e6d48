"""A pipeline schedule run on simulator executor processes, one per device, against the
planner's simulation of it with the communication cost and the executors' per-op time profiled
in the same run: `flowkit schedule --execute` and `flowkit bench pipeline`."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from flowkit.planner import Costs, Schedule, simulate
from flowkit.runner.pipeline import stage_costs_config, submit_schedule
from flowkit.runtime import Controller, LocalExecutors, wait
from flowkit.runtime.registry import ExecutorInfo

__all__ = ["execute_on_simulators", "profile_hop", "profile_op_overhead"]


def execute_on_simulators(schedule: Schedule, stage_costs: Costs, *, unit_s: float = 0.001,
                          repeats: int = 3, activation_bytes: int = 1 << 16) -> dict:
    """Run `schedule` on one simulator executor per device, costs in units of `unit_s`
    seconds: the median of `repeats` runs after a warm-up, against the planner's simulation.

    The simulation's costs are profiled in the same run, as the Zero Bubble paper profiles
    T_F, T_B, T_W and T_comm: each op's cost gains the executors' own per-op time (one op's
    start to the next's on a busy executor, less the op's nominal time, with every executor
    busy at once as in the run), and the communication cost is the median time an activation
    takes from the end of the op that made it to the start of the op that reads it on another
    executor that has been waiting for it (an idle executor wakes more slowly than a busy one).
    With them, measured against simulated says whether the schedule's order costs anything
    the simulator does not know of.
    """
    seconds = _in_seconds(stage_costs, unit_s)
    config_for = stage_costs_config(seconds, activation_bytes=activation_bytes)
    with Controller() as ctl, LocalExecutors(ctl, schedule.num_devices, kind="sim",
                                             name_prefix="sim") as started:
        infos = sorted(started, key=lambda e: int(e.name.rsplit("-", 1)[1]))
        hop_s = (profile_hop(ctl, infos, activation_bytes, hops=50, op_s=unit_s)
                 if len(infos) > 1 else 0.0)
        op_overhead_s = profile_op_overhead(ctl, infos, unit_s)
        runs = []
        for _ in range(repeats + 1):  # the first run warms up sockets and caches
            run = submit_schedule(ctl, schedule, infos, config_for=config_for)
            run.wait(timeout=60 + 10 * simulate(schedule, seconds).makespan)
            runs.append(run.measured())
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
    value = ctl.submit("make_tensor", config={"nbytes": nbytes}, executor=executors[0].id)
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


def _in_seconds(costs: Costs, unit_s: float) -> Costs:
    return Costs(F=[c * unit_s for c in costs.F], B=[c * unit_s for c in costs.B],
                 W=[c * unit_s for c in costs.W], comm=costs.comm * unit_s)
