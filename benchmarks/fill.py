"""Bubble filling: what lending the training executors' pipeline bubbles to a step's scoring
buys (`flowkit run --fill-bubbles`, [Note: bubble filling] in flowkit/runner/bubble_fill.py).

Method: a fused GRPO step (`grpo_flow(prompts=32, n=8, stages=4, microbatches=8,
schedule="1f1b", max_new_tokens=64)`) on 2 rollout and 4 train simulator executors whose F, B
and W take 10 ms, a decode iteration 0.5 ms and the reference's scoring 0.2 ms a token (about
6 ms a sample, so scoring outweighs generation), three ways on the same executors, each its
own run:

- `on trainers`: the reference scores where the actor trains (the RL flows' default: its
  tags), its tasks in the trainers' queues beside the pipeline's;
- `apart`: the reference beside the engines (`reference_tags=("rollout",)`), the trainers
  training only;
- `filled`: apart, and the trainers' bubbles lent to the reference's waiting items.

Per way, medians over the steps after the first: the step's seconds; the pipeline's makespan
(its first op's start to its last op's end, `pipeline_makespan_s`, which in a fused step
follows when the scored samples come); `held_back_ms`, what the pipeline's ops waited past the
moment the schedule let them start (the later of their inputs' ends and their device's
previous op's end), in all, leaving out the first stage's forwards (they wait for data): the
critical path moves by what other work on a trainer holds its ops back, so a filler that keeps
to its bubble adds none; and the reference items scored on trainers (in bubbles when filled).
`filled_over_apart` and `filled_over_on_trainers` are ratios of step times in the same run.
"""

from __future__ import annotations

import statistics
from typing import Any

import attrs

__all__ = ["FillSetup", "run_fill_bench"]

WAYS = ("on trainers", "apart", "filled")


@attrs.frozen
class FillSetup:
    steps: int = 5  # the first is left out (it learns the scoring's cost)
    prompts: int = 32
    op_s: float = 0.010  # the simulator's F, B and W
    infer_token_s: float = 0.0002  # the reference's scoring, a token


def run_fill_bench(setup: FillSetup | None = None) -> dict:
    from flowkit.planner.simcosts import SimCosts
    from flowkit.runtime import Controller, LocalExecutors

    setup = setup or FillSetup()
    if setup.steps < 2:
        raise ValueError(f"the bench measures the steps after the first: needs >= 2, got "
                         f"{setup.steps}")
    costs = SimCosts(F=setup.op_s, B=setup.op_s, W=setup.op_s, optimizer_step=setup.op_s / 2,
                     token=0.0005, token_per_seq=0.0, prefill_token=0.0,
                     infer_token=setup.infer_token_s)
    tags = [("rollout",)] * 2 + [("train",)] * 4
    out: dict[str, Any] = {"setup": attrs.asdict(setup)}
    with Controller() as ctl, LocalExecutors(ctl, len(tags), kind="sim", tags=tags):
        trainers = {e.id for e in ctl.executors() if "train" in e.tags}
        for way in WAYS:
            out[way] = _measure(ctl, setup, costs, way, trainers)
    out["filled_over_apart"] = out["filled"]["step_s"] / out["apart"]["step_s"]
    out["filled_over_on_trainers"] = out["filled"]["step_s"] / out["on trainers"]["step_s"]
    return out


def _measure(ctl: Any, setup: FillSetup, costs: Any, way: str, trainers: set[int]) -> dict:
    from benchmarks.runs import bench_run
    from dataflows.grpo import grpo_flow

    flow = grpo_flow(prompts=setup.prompts, n=8, stages=4, microbatches=8, schedule="1f1b",
                     max_new_tokens=64,
                     reference_tags=() if way == "on trainers" else ("rollout",))
    on_trainers = [0]

    def count(event: str, payload: dict) -> None:
        task = payload.get("task")
        if event == "task_submitted" and (task.meta or {}).get("node") == "ref_logprobs" \
                and payload["executor"].id in trainers:
            on_trainers[0] += task.items or 1

    rows = []
    ctl.add_listener(count)
    try:
        with bench_run(flow, controller=ctl, steps=setup.steps, executors="sim",
                       sim_costs=costs, fill_bubbles=way == "filled",
                       step_timeout=600) as run:
            before = on_trainers[0]
            for report in run.steps():
                metrics = report.metrics
                pipeline = run.runner.last_run.states["update_actor"].pipeline
                rows.append({"step_s": report.elapsed_s,
                             "pipeline_makespan_s": metrics["pipeline_makespan_s"],
                             "held_back_ms": held_back(pipeline.submitter.runs[0]) * 1e3,
                             "scored_on_trainers": on_trainers[0] - before})
                before = on_trainers[0]
    finally:
        ctl.remove_listener(count)
    rows = rows[1:]
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def held_back(run: Any) -> float:
    """Seconds the ops of a finished PipelineRun waited past the later of their inputs' ends
    and their device's previous op's end, in all; the first stage's forwards, which wait for
    their microbatch's data, left out."""
    from flowkit.planner import Kind, action_key
    from flowkit.planner.simulate import dependencies

    schedule = run.schedule
    ends = {action.key: run.futures[action].timing[1] for action in run.futures}
    waited = 0.0
    for ops in schedule.device_ops:
        previous_end = None
        for action in ops:
            if action not in run.futures:  # a copy: carried by a compute op
                continue
            start, end = run.futures[action].timing
            if not (action.kind is Kind.F and action.stage == 0):
                ready = max([ends[action_key(*dep)] for dep in
                             dependencies(action, schedule.num_stages)] +
                            ([previous_end] if previous_end is not None else []))
                waited += max(0.0, start - ready)
            previous_end = end
    return waited

