"""`flowkit bench train --microbatch-tokens N`: a step of D = 4 replicas on simulator executors
(real processes, modelled costs) with per-token F, B and W costs [Note: per-token costs in
executors/sim/ops.py], its microbatches cut by count (microbatch g on replica g mod D) against
token-budget ones [Note: token-budget microbatches in flowkit/runner/token_microbatches.py],
the same samples (log-normal response lengths: median 64, sigma 1, budget 512): the step's time
and each replica's wait for the others before its all-reduce."""

from __future__ import annotations

import statistics
from typing import Any

import attrs

__all__ = ["BalanceSetup", "run_token_balance_bench"]


@attrs.frozen(kw_only=True)
class BalanceSetup:
    replicas: int = 4
    batch_size: int = 128  # samples a step
    microbatches: int = 16  # by count: 4 a replica
    microbatch_tokens: int = 1024
    steps: int = 5  # per mode; the first (a barrier) is not counted
    # a small GPT's stage on one GPU: ~20 µs a token for each of F, B and W, 0.5 ms fixed,
    # 100 MB of gradients at 25 Gb/s
    costs: str = ("F=0.0005,B=0.0005,W=0.0005,F_token=0.00002,B_token=0.00002,"
                  "W_token=0.00002,optimizer_step=0.001,grad_bytes=1e8,allreduce_gbps=25")


def _flow(setup: BalanceSetup, *, tokens: bool):
    from benchmarks.packing import lognormal_experiences
    from dataflows.model_ops import Backprop, OptimizerStep
    from dataflows.models import GPT_BUILD
    from flowkit.dsl import Flow, Model, collect

    name = "by-tokens" if tokens else "by-count"
    model = Model(name=name, build=GPT_BUILD, stages=1, replicas=setup.replicas,
                  tags=("train",))
    cut = {"microbatch_tokens": setup.microbatch_tokens} if tokens else {}
    with Flow(f"token-balance-{name}") as flow:
        samples = lognormal_experiences(sequences=setup.batch_size)
        stats = Backprop(model)(samples, loss="ppo", schedule="1f1b",
                                microbatches=setup.microbatches, **cut)
        OptimizerStep(model)(collect(stats), lr=1e-4)
    return flow


def run_token_balance_bench(setup: BalanceSetup | None = None) -> dict:
    """By count, then by tokens, on the same simulator executors: the median step after the
    first and each replica's median wait before its all-reduce; their ratios."""
    from flowkit.planner.simcosts import SimCosts
    from flowkit.runtime import Controller, LocalExecutors

    setup = setup or BalanceSetup()
    costs = SimCosts.parse(setup.costs)
    out: dict[str, Any] = {"setup": attrs.asdict(setup)}
    with Controller() as ctl, LocalExecutors(ctl, setup.replicas, kind="sim", tags=("train",)):
        for mode in ("by_count", "by_tokens"):
            flow = _flow(setup, tokens=mode == "by_tokens")
            out[mode] = _measured(ctl, flow, setup.steps, costs)
    out["step_by_tokens_over_by_count"] = out["by_tokens"]["step_s"] / out["by_count"]["step_s"]
    return out


def _measured(ctl: Any, flow: Any, steps: int, costs: Any) -> dict:
    """The median step after the first, and per replica (its executor) the median seconds
    between its last F/B/W of a step and the start of its all-reduce, which waits for every
    replica's last action."""
    from benchmarks.runs import bench_run

    computed: dict[int, float] = {}  # executor -> its last pipeline op's end this step
    waits: dict[int, list[float]] = {}

    def listen(event: str, payload: dict) -> None:
        task = payload.get("task")
        if event != "task_done" or task is None:
            return
        if task.op in ("F", "B", "W", "BW"):
            computed[task.executor] = max(computed.get(task.executor, 0.0), task.end)
        elif task.op == "reduce_grads" and task.executor in computed:
            waits.setdefault(task.executor, []).append(task.start - computed[task.executor])

    ctl.add_listener(listen)
    rows = []
    try:
        with bench_run(flow, controller=ctl, steps=steps, executors="sim",
                       sim_costs=costs) as run:
            for report in run.steps():
                rows.append(report.elapsed_s)
                computed.clear()
    finally:
        ctl.remove_listener(listen)
    per_replica = [statistics.median(w[1:] or w) for _, w in sorted(waits.items())]
    return {"step_s": statistics.median(rows[1:]), "allreduce_wait_s": per_replica,
            "mean_wait_s": statistics.fmean(per_replica) if per_replica else 0.0}
