"""What a step reports when it ends (`StepReport`): the part of a `StepRun` (steprun.py) that
reads its outputs, trainings, policies and balancers into metrics.
"""

from __future__ import annotations

import time
from typing import Any

import attrs

from flowkit.dsl import Metrics
from flowkit.ops.records import mean_loss, mean_values
from flowkit.planner.lower import NodePlan
from flowkit.runner.device_reports import activation_memory, model_flops
from flowkit.runner.mfu import mfu
from flowkit.runner.pipeline import measure
from flowkit.wire.refs import Item

__all__ = ["StepReport", "step_report"]


@attrs.frozen
class StepReport:
    step: int
    elapsed_s: float
    timing_s: dict[str, float]  # per node: first op start to last op end
    metrics: dict[str, Any]  # loss, bubble rate, ... from the step's outputs
    warnings: tuple[str, ...] = ()  # what the user should act on, from the runner and reporters


def step_report(run: Any) -> StepReport:
    """What step `run` (a StepRun that has closed) reports: its nodes' timing, the losses,
    the reporters' metrics, the call policies', balancers' and trainings' figures."""
    timing = {name: s.last_end - s.first_start for name, s in run.states.items()
              if s.first_start is not None and s.last_end is not None}
    metrics: dict[str, Any] = {}
    runs = [run for state in run.states.values() if state.pipeline is not None
            for run in state.pipeline.runs]
    predicted = [v for t in run.trainings.values()
                 for v in t.predicted_bubble.values()]
    for name, state in run.states.items():
        if state.pipeline is not None:  # over every round's microbatches, if in rounds
            losses = [f.result() for run in state.pipeline.runs for f in run.losses]
            metrics[f"{name}/loss"], metrics[f"{name}/tokens"] = mean_loss(losses)
            metrics.update({f"{name}/{key}": value
                            for key, value in mean_values(losses).items()})
            if state.pipeline.optimizer_steps > 1:
                metrics[f"{name}/optimizer_steps"] = state.pipeline.optimizer_steps
    for state in run.states.values():
        if state.plan.reports:
            metrics.update(_reported(run, state.plan))
    for training in run.trainings.values():
        synced = training.sync_bytes(run.wiring.step_timeout)
        if synced is not None:
            metrics[f"{training.model.name}/sync_bytes"] = synced
        metrics.update(activation_memory(training, run.wiring.step_timeout))
    for node, count in run.incomplete_groups.items():
        metrics[f"{node}/incomplete_groups"] = count
    if run.submission.bubble_fill is not None:  # [Note: bubble filling in bubble_fill.py]
        for name, state in run.states.items():
            if state.plan.scores:
                metrics[f"{name}/bubble_items"] = state.filled
    for policy in run.policies.values():
        metrics.update(policy.metrics(run.wiring.step_timeout))
    for node, balancer in run.balancers.items():
        if balancer is not None:
            metrics.update(balancer.end_step(node))
    if runs:
        # over every executor's pipeline ops, whichever model they belong to: two models'
        # pipelines sharing executors fill each other's bubbles
        measured = measure((f.location, f.timing) for run in runs
                           for f in run.futures.values())
        metrics["bubble_rate"] = measured["bubble_rate"]
        # the step's pipeline ops, first start to last end: the training part of the step
        metrics["pipeline_makespan_s"] = measured["makespan"]
        metrics["predicted_bubble_rate"] = max(predicted) if predicted else None
    flops = [model_flops(training, run.wiring.step_timeout)
             for training in run.trainings.values()]
    elapsed = time.time() - run.started
    utilization = mfu(flops, elapsed)
    if utilization is not None:
        metrics["mfu"] = utilization
    return StepReport(step=run.step, elapsed_s=elapsed, timing_s=timing,
                      metrics=metrics, warnings=tuple(run.warnings))


def _reported(run: Any, plan: NodePlan) -> dict[str, float]:
    """The values of a reporter's Metrics items this step (small: fetched to here)."""
    values: dict[str, float] = {}
    timeout = run.wiring.step_timeout
    for port in plan.outputs:
        for ref in run.streams[(plan.name, port)].ordered():
            item = ref.future.result(timeout=timeout)[ref.index] \
                if isinstance(ref, Item) else ref.result(timeout=timeout)
            if isinstance(item, Metrics):
                values.update(item.values)
                run.warnings.extend(item.warnings)
    return values
