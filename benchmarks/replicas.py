"""Data parallel × pipeline parallel benchmark: tokens/s as replicas are added, against one
replica measured in the same run (weak scaling: each replica trains the same share, so the
global batch grows with D; scaling efficiency = tokens/s(D) / (D × tokens/s(1))).

(a) torch on this machine's CPU: the built-in GPT of `flowkit bench train`, one stage a
    replica, D = 1 and 2 executor processes, gloo all-reduce; the all-reduce's share of the step
    (its reduce_grads tasks' time over the step's).
(b) the simulator executor (real processes, modelled costs) at D = 1, 2, 4 with P = 2: the
    step measured against the planner's timing of the same plan (simulate_replicas), and the
    share of the all-reduce hidden behind other devices' backward passes.
(c) the planner's timing for a 1B-parameter model at D = 1, 2, 4, 8 and P = 2, 4 under 1f1b and
    zb-h1: fp32 gradients (4 bytes a parameter) summed by a ring all-reduce at 10, 25, 100 and
    400 Gb/s; per microbatch 8,192 tokens, F = B = W = 2 × 1e9 × 8,192 FLOPs at 200 TFLOP/s
    over the P stages, 32 microbatches a replica.
"""

from __future__ import annotations

import statistics
from typing import Any

import attrs

__all__ = ["run_overlap_bench", "run_replicas_bench"]

PARAMS, TOKENS, FLOPS = 1e9, 8192, 200e12  # (c): the model, a microbatch, effective device speed
GBPS = (10.0, 25.0, 100.0, 400.0)


SIM_COSTS = "F=0.004,B=0.004,W=0.004,optimizer_step=0.001,grad_bytes=1e9,allreduce_gbps=400"


def run_replicas_bench(*, cpu_replicas: tuple[int, ...] = (1, 2), steps: int = 5,
                       sim_replicas: tuple[int, ...] = (1, 2, 4), sim_stages: int = 2,
                       sim_microbatches: int = 8, sim_costs: str = SIM_COSTS) -> dict:
    """(a), (b) and (c) of the module docstring; the sim_* settings choose (b)'s runs."""
    return {"cpu": _cpu(cpu_replicas, steps),
            "simulator": _sim_processes(steps, sim_replicas, sim_stages, sim_microbatches,
                                        sim_costs),
            "planner": _planner_grid()}


def _cpu(replicas: tuple[int, ...], steps: int) -> dict:
    """(a): per D, the median step after the first, tokens/s and the all-reduce's share."""
    import tempfile
    from pathlib import Path

    from benchmarks.train import TrainSetup, _corpus, _model
    from dataflows.pretrain import pretrain_flow
    from flowkit.runtime import Controller, LocalExecutors

    setup = TrainSetup(stages=1, microbatches=4, batch_size=16)
    out: dict[str, Any] = {"setup": {"gpt": setup.gpt, "per_replica_sequences": 16,
                                     "seq_len": setup.seq_len, "microbatches": 4}}
    with tempfile.TemporaryDirectory() as tmp, Controller() as ctl, LocalExecutors(
            ctl, max(replicas), kind="torch", tags=("train",)):
        corpus = _corpus(Path(tmp))
        for count in replicas:
            name = f"dp{count}"
            flow = pretrain_flow(corpus=corpus, microbatches=4 * count,
                                 batch_size=16 * count, seq_len=setup.seq_len,
                                 model=_model(setup, name))
            flow.models[name] = attrs.evolve(flow.models[name], replicas=count)
            out[f"D={count}"] = _measured(ctl, flow, steps, 16 * count * setup.seq_len,
                                          executors="torch")
    base = out["D=1"]
    for count in replicas:
        row = out[f"D={count}"]
        row["scaling_efficiency"] = row["tokens_per_s"] / (count * base["tokens_per_s"])
    out["machine_ceiling"] = _parallel_ceiling(max(replicas))
    return out


def _parallel_ceiling(count: int) -> float:
    """What `count` processes computing at once get of `count` times one process's speed on
    this machine (a 2-vCPU machine may not give two cores' worth): the CPU rows' baseline."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    rates = []
    for processes in (1, count):
        with context.Pool(processes) as pool:
            seconds = pool.map(_matmuls, [200] * processes)
        rates.append(processes / max(seconds))
    return rates[1] / (count * rates[0])


def _matmuls(repeats: int) -> float:
    import time

    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    a @ a
    start = time.perf_counter()
    for _ in range(repeats):
        a @ a
    return time.perf_counter() - start


def _measured(ctl: Any, flow: Any, steps: int, tokens: int, **settings: Any) -> dict:
    """Median step after the first, tokens/s, and the reduce_grads tasks' seconds a step on
    the executor that spent the most on them."""
    from benchmarks.runs import bench_run

    reduced: dict[int, float] = {}

    def listen(event: str, payload: dict) -> None:
        task = payload.get("task")
        if event == "task_done" and task.op == "reduce_grads":
            reduced[task.executor] = reduced.get(task.executor, 0.0) + task.end - task.start

    ctl.add_listener(listen)
    rows = []
    try:
        with bench_run(flow, controller=ctl, steps=steps, **settings) as run:
            for report in run.steps():
                rows.append((report.elapsed_s, max(reduced.values(), default=0.0)))
                reduced.clear()
    finally:
        ctl.remove_listener(listen)
    step_s = statistics.median(s for s, _ in rows[1:])
    reduce_s = statistics.median(r for _, r in rows[1:])
    return {"step_s": step_s, "tokens_per_s": tokens / step_s, "allreduce_s": reduce_s,
            "allreduce_share": reduce_s / step_s}


def _sim_processes(steps: int, counts: tuple[int, ...], devices: int, microbatches: int,
                   cost_spec: str) -> dict:
    """(b): the simulator executor against the planner, by default P = 2, D = 1, 2, 4: 1 GB of
    gradients at 400 Gb/s (10 ms to reduce a device's share at D = 2, 15 ms at D = 4) against
    F = B = W = 4 ms, 8 microbatches a replica."""
    import tempfile
    from pathlib import Path

    from benchmarks.train import _corpus
    from dataflows.pretrain import pretrain_flow
    from flowkit.planner.replicas import simulate_replicas
    from flowkit.planner.schedules import build_schedule
    from flowkit.planner.simcosts import SimCosts
    from flowkit.runtime import Controller, LocalExecutors

    costs = SimCosts.parse(cost_spec)
    out: dict[str, Any] = {"costs": {"F": costs.F, "B": costs.B, "W": costs.W,
                                     "grad_bytes": costs.grad_bytes,
                                     "allreduce_gbps": costs.allreduce_gbps},
                           "devices": devices, "microbatches_per_replica": microbatches}
    with tempfile.TemporaryDirectory() as tmp, Controller() as ctl, LocalExecutors(
            ctl, devices * max(counts), kind="sim", tags=("train",)):
        corpus = _corpus(Path(tmp))
        for count in counts:
            name = f"sim-dp{count}"
            flow = pretrain_flow(corpus=corpus, stages=devices, seq_len=16,
                                 microbatches=microbatches * count, schedule="1f1b",
                                 batch_size=microbatches * count, model_name=name)
            flow.models[name] = attrs.evolve(flow.models[name], replicas=count)
            row = _measured(ctl, flow, steps, microbatches * count, executors="sim",
                            sim_costs=costs)
            stage = costs.stage_costs(devices)
            schedule = build_schedule("1f1b", devices=devices, microbatches=microbatches,
                                      costs=stage)
            predicted = simulate_replicas(schedule, stage, costs.allreduce_s(count, devices))
            row.update(predicted_step_s=predicted.step + costs.optimizer_step,
                       predicted_hidden=predicted.hidden)
            out[f"D={count}"] = row
    base = out["D=1"]["step_s"]
    for count in counts:
        out[f"D={count}"]["scaling_efficiency"] = base / out[f"D={count}"]["step_s"]
    return out


def _planner_grid() -> dict:
    """(c): scaling efficiency = step(D=1) / step(D) of a 1B-parameter model, the all-reduce
    after each device's last action (today's runtime) and overlapped with its last W
    [Note: overlapped all-reduce in flowkit/planner/replicas.py]."""
    out: dict[str, Any] = _planner_setup()
    for kind in ("1f1b", "zb-h1"):
        for devices in (2, 4):
            for gbps in GBPS:
                for count in (1, 2, 4, 8):
                    out[f"{kind} P={devices} {gbps:g}Gb/s D={count}"] = _planner_row(
                        kind, devices, gbps, count)
    return out


def run_overlap_bench(*, replicas: int = 8, devices: int = 4) -> dict:
    """The planner alone, in a second: the share of the all-reduce hidden and the step of the
    1B model at D = `replicas`, P = `devices` under 1f1b, zb-h1 and zb-v (two stages a
    device) at each link speed, reduced after the device's last action against overlapped with
    each stage's last W, bucket by bucket."""
    out: dict[str, Any] = _planner_setup()
    out.update(replicas=replicas, devices=devices)
    for kind in ("1f1b", "zb-h1", "zb-v"):
        for gbps in GBPS:
            out[f"{kind} {gbps:g}Gb/s"] = _planner_row(kind, devices, gbps, replicas)
    return out


def _planner_setup() -> dict:
    from flowkit.planner.replicas import GRAD_BUCKET_BYTES

    return {"params": PARAMS, "grad_bytes": 4 * PARAMS, "tokens_per_microbatch": TOKENS,
            "microbatches_per_replica": 32, "F_B_W_whole_model_s": _whole_model_s(),
            "bucket_bytes": GRAD_BUCKET_BYTES}


def _whole_model_s() -> float:
    """One microbatch's forward through the whole model."""
    return 2 * PARAMS * TOKENS / FLOPS


def _planner_row(kind: str, devices: int, gbps: float, count: int) -> dict:
    """One setting timed both ways: the keys without a suffix are today's runtime (the
    all-reduce after the device's last action), `_overlapped` the buckets reduced as the
    device's last W makes them final."""
    from flowkit.planner import Costs
    from flowkit.planner.replicas import buckets_for, simulate_replicas
    from flowkit.planner.schedules import build_schedule
    from flowkit.planner.simcosts import SimCosts

    share = _whole_model_s() / devices
    costs = Costs.uniform(devices, F=share, B=share, W=share)
    schedule = build_schedule(kind, devices=devices, microbatches=32, costs=costs)
    stage_costs = costs.for_placement(schedule.placement)
    chunks = schedule.num_stages // devices  # a device's share split over its stages
    seconds = SimCosts(grad_bytes=4 * PARAMS, allreduce_gbps=gbps).allreduce_s(count, devices) \
        / chunks
    base = simulate_replicas(schedule, stage_costs, 0.0).step
    after = simulate_replicas(schedule, stage_costs, seconds)
    overlapped = simulate_replicas(schedule, stage_costs, seconds, overlap=True,
                                   buckets=buckets_for(4 * PARAMS / devices / chunks))
    return {"step_s": after.step, "allreduce_s": after.allreduce, "hidden": after.hidden,
            "scaling_efficiency": base / after.step, "step_s_overlapped": overlapped.step,
            "hidden_overlapped": overlapped.hidden,
            "scaling_efficiency_overlapped": base / overlapped.step}
