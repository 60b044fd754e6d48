"""Fused actor and critic pipelines: what one schedule for both models buys PPO's training
(`ppo_flow(fuse_models=True)`, [Note: fused training in flowkit/runner/fusedtrain.py]).

Method. Planner: 1F1B and ZB-H1 on 4 devices, 8 microbatches, unit costs: each model's pipeline
alone, the two one after the other, and fused with the critic's stages on the same devices the
same way and the other way round (RLHFuse's layout), with no memory limit and with the limit of
one model alone; the simulated makespan, bubble rate and peak activation memory of each.

Measured: a PPO step (16 prompts, actor and critic in 4 stages, 8 microbatches) on 4
simulator executors whose F, B and W take 10 ms, and on torch executors (the tiny GPT in 2
stages on 2 CPU executors, a third generating), three ways on the same executors, each its own
run: `in turn` (the fused group with the models one after the other on each executor: the two
separate pipelines' sum), `lanes` (no fusion: each model in its own lanes, the critic on the
same executors with its stages rotated, and the executors interleaving whatever op of either
model is ready: no memory bound), `fused`. Per way: the step's pipeline makespan (first
pipeline op's start to the last one's end, `pipeline_makespan_s`, median over the steps
after the first), its measured bubble rate, and on the simulator the most activation memory
any executor held (microbatches of a device's share, both models together); with a memory
limit of one model alone too (`lanes` cannot keep one).
"""

from __future__ import annotations

import statistics
from typing import Any

import attrs

__all__ = ["FusedSetup", "run_fused_bench"]

WAYS = ("in turn", "lanes", "fused")


@attrs.frozen
class FusedSetup:
    devices: int = 4
    microbatches: int = 8
    kinds: tuple[str, ...] = ("1f1b", "zb-h1")
    op_s: float = 0.010  # the simulator's F, B and W
    prompts: int = 16
    steps: int = 4  # the first is left out
    torch: bool = True


def run_fused_bench(setup: FusedSetup | None = None) -> dict:
    setup = setup or FusedSetup()
    if setup.steps < 2:
        raise ValueError(f"the bench measures the steps after the first: needs >= 2, got "
                         f"{setup.steps}")
    out: dict[str, Any] = {"setup": attrs.asdict(setup), "planner": _planned(setup)}
    out["simulator"] = {kind: _measured_sim(setup, kind) for kind in setup.kinds}
    if setup.torch:
        out["torch"] = _measured_torch(setup)
    return out


# -- the planner ----------------------------------------------------------------------------------
def _planned(setup: FusedSetup) -> dict:
    from flowkit.planner import Costs, simulate
    from flowkit.planner.fused import fuse, sequential, simulate_fused
    from flowkit.planner.schedules import build_schedule

    p, costs = setup.devices, Costs.uniform(setup.devices)
    out = {}
    for kind in setup.kinds:
        one = build_schedule(kind, devices=p, microbatches=setup.microbatches, costs=costs)
        alone = simulate(one, costs)
        row: dict[str, Any] = {"alone": _figures(alone)}
        row["in turn"] = _figures(simulate_fused(sequential([one, one]), costs))
        limit = max(alone.peak_memory)
        for layout, devices in (("same way", [range(p), range(p)]),
                                ("other way", [range(p), range(p - 1, -1, -1)])):
            for name, cap in ((layout, None), (f"{layout}, limit {limit:g}", limit)):
                fused = fuse([one, one], costs, devices=devices, memory_limit=cap)
                row[f"fused {name}"] = _figures(simulate_fused(fused, costs))
        row["fused/in turn"] = row["fused other way"]["makespan"] / row["in turn"]["makespan"]
        out[kind] = row
    return out


def _figures(result: Any) -> dict:
    return {"makespan": result.makespan, "bubble_rate": round(result.bubble_rate, 4),
            "peak_memory": max(result.peak_memory)}


# -- on simulator executors -----------------------------------------------------------------------
def _measured_sim(setup: FusedSetup, kind: str) -> dict:
    from flowkit.planner.simcosts import SimCosts
    from flowkit.runtime import Controller, LocalExecutors

    costs = SimCosts(F=setup.op_s, B=setup.op_s, W=setup.op_s)
    out: dict[str, Any] = {}
    with Controller() as ctl, LocalExecutors(ctl, setup.devices, kind="sim",
                                             tags=("train", "rollout")):
        alone = None
        for limit in (None, "alone"):
            for way in WAYS:
                cap = alone if limit else None
                flow = _ppo(setup, kind, stages=setup.devices, fuse=way != "lanes", limit=cap)
                got = _steps(ctl, flow, way, setup.steps, sim_costs=costs)
                if alone is None and got["predicted"]:
                    alone = got["predicted"]["alone_peak"]
                out[way if limit is None else f"{way}, limit {alone:g}"] = got
    for suffix in ("", f", limit {alone:g}"):
        out[f"fused/in turn{suffix}"] = (out[f"fused{suffix}"]["pipeline_makespan_s"]
                                         / out[f"in turn{suffix}"]["pipeline_makespan_s"])
    out["fused/lanes"] = out["fused"]["pipeline_makespan_s"] / out["lanes"]["pipeline_makespan_s"]
    return out


def _ppo(setup: FusedSetup, kind: str, *, stages: int, fuse: bool, limit: float | None,
         **more: Any) -> Any:
    from dataflows.ppo import ppo_flow

    flow = ppo_flow(prompts=setup.prompts, microbatches=setup.microbatches, stages=stages,
                    schedule=kind, fuse_models=fuse, **more)
    for node in ("update_actor", "update_critic"):  # offload none: report activation memory
        flow.nodes[node].config.update(offload="none", memory_limit=limit)
    return flow


def _steps(ctl: Any, flow: Any, way: str, steps: int, **runner: Any) -> dict:
    from flowkit.planner import simulate
    from flowkit.planner.fused import sequential
    from flowkit.planner.lower import lower_flow
    from flowkit.runner.flowrun import FlowRunner

    run = FlowRunner(ctl, lower_flow(flow), **runner)
    if way == "in turn":
        run.fusions[0].plan_with = lambda schedules, costs, **kw: sequential(
            schedules, kw["devices"], kw["names"])
    reports = [run.run_step(step) for step in range(steps)]
    measured = reports[1:]
    peaks = [max((v for k, v in r.metrics.items() if "/peak_activation_" in k
                  and "/device" not in k), default=0.0) for r in measured]
    out = {"pipeline_makespan_s": statistics.median(r.metrics["pipeline_makespan_s"]
                                                    for r in measured),
           "bubble_rate": statistics.median(r.metrics["bubble_rate"] for r in measured),
           "peak_activation": max(peaks), "predicted": None}
    if run.fusions:
        fusion = run.fusions[0]
        schedule, costs = fusion.planned[0][0], fusion.planned[0][1]
        out["predicted"] = {**fusion.predicted,
                            "alone_peak": max(simulate(schedule, costs).peak_memory)}
    return out


# -- on torch executors ---------------------------------------------------------------------------
def _measured_torch(setup: FusedSetup) -> dict:
    from flowkit.runtime import Controller, LocalExecutors

    gpt = {"vocab_size": 64, "block_size": 32, "n_layer": 4, "n_head": 2, "n_embd": 64,
           "seed": 0}
    out: dict[str, Any] = {"model": gpt, "stages": 2}
    tags = [("train",), ("train",), ("rollout",)]
    with Controller() as ctl, LocalExecutors(ctl, 3, kind="torch", tags=tags):
        for way in WAYS:
            flow = _ppo(setup, "zb-h1", stages=2, fuse=way != "lanes", limit=None,
                        gpt=gpt, max_new_tokens=16)
            got = _steps(ctl, flow, way, setup.steps)
            got.pop("peak_activation")  # bytes on torch, by model: not the simulator's units
            out[way] = got
    out["fused/in turn"] = (out["fused"]["pipeline_makespan_s"]
                            / out["in turn"]["pipeline_makespan_s"])
    out["fused/lanes"] = out["fused"]["pipeline_makespan_s"] / out["lanes"]["pipeline_makespan_s"]
    return out
