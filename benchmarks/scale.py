"""Scale benchmark: what the engine costs per sample as a GRPO step grows, on simulator executors
whose model ops cost next to nothing, so the step's time is the control plane's.

Method: `grpo_flow(prompts=P, n=8, microbatches=16, max_new_tokens=32)` on 4 rollout and 2 train
simulator executors, every model cost (F, B, W, optimizer step, a decode iteration, a token of
inference) 10 µs; `steps` steps each fused and stage by stage (barrier), side by side on the same
executors; per size and mode the median step time of the steps after the first, and that over
the step's samples. `fused_over_barrier` is the ratio of the two step times in the same run.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["run_scale_bench"]

COST_S = 1e-5  # every simulated model op and decode iteration
ROLLOUT, TRAIN = 4, 2  # executors


def run_scale_bench(*, samples: Sequence[int] = (1024, 2048, 4096), steps: int = 4) -> dict:
    """Per size (samples a step, a multiple of 8): fused and barrier step seconds and
    milliseconds per sample."""
    from benchmarks.runs import bench_run
    from dataflows.grpo import grpo_flow
    from flowkit.planner.simcosts import SimCosts
    from flowkit.runtime import Controller, LocalExecutors

    if steps < 2:
        raise ValueError(f"the bench measures the steps after the first: needs >= 2, got {steps}")
    costs = SimCosts(F=COST_S, B=COST_S, W=COST_S, optimizer_step=COST_S, token=COST_S,
                     infer_token=COST_S)
    tags = [("rollout",)] * ROLLOUT + [("train",)] * TRAIN
    out: dict = {"steps": steps, "cost_s": COST_S, "executors": {"rollout": ROLLOUT,
                                                                 "train": TRAIN}}
    with Controller() as ctl, LocalExecutors(ctl, len(tags), kind="sim", tags=tags):
        for count in samples:
            figures = {}
            for mode, fuse in (("fused", True), ("barrier", False)):
                flow = grpo_flow(prompts=max(1, count // 8), n=8, microbatches=16,
                                 max_new_tokens=32)
                with bench_run(flow, controller=ctl, steps=steps, executors="sim",
                               sim_costs=costs, fuse=fuse, step_timeout=3600) as run:
                    times = [report.elapsed_s for report in run.steps()]
                step_s = statistics.median(times[1:])
                figures[mode] = {"step_s": step_s, "ms_per_sample": step_s / count * 1e3}
            figures["fused_over_barrier"] = (figures["fused"]["step_s"]
                                             / figures["barrier"]["step_s"])
            out[str(count)] = figures
    return out
