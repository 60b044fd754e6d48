"""The body of `flowkit run`: start executors, run the steps, observe, report."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from flowkit.dsl import Flow
from flowkit.observe import Dashboard, MetricsWriter, RunStats, TraceRecorder
from flowkit.planner.lower import NodePlan, lower_flow
from flowkit.planner.simcosts import SimCosts
from flowkit.runtime import Controller, LocalExecutors
from flowkit.runtime.flowrun import FlowRunError, FlowRunner, StepReport

__all__ = ["executor_tags", "run_flow"]


def executor_tags(plan: list[NodePlan], count: int, tag_spec: str | None) -> list[tuple]:
    """One tag tuple per executor: as given ('a,b;c'), or every tag the flow asks for."""
    if tag_spec:
        groups = [tuple(t for t in part.split(",") if t) for part in tag_spec.split(";")]
        if len(groups) != count:
            raise click.BadParameter(f"{len(groups)} tag groups for {count} executors: give one "
                                     "per executor, ';' between them", param_hint="--tags")
        return groups
    wanted = sorted({tag for node in plan for tag in node.tags})
    return [tuple(wanted)] * count


def run_flow(flow: Flow, *, code: list[str], kind: str, count: int | None,
             tag_spec: str | None, steps: int, sim_costs: SimCosts | None,
             trace: Path | None, metrics: Path | None, dashboard: bool | None) -> None:
    plan = lower_flow(flow)
    stages = max((node.model.stages for node in plan if node.model is not None), default=1)
    count = count or max(2, stages)
    tags = executor_tags(plan, count, tag_spec)
    console = Console(stderr=False)
    recorder = TraceRecorder()
    stats = RunStats()
    writer = MetricsWriter(metrics) if metrics is not None else None
    with Controller() as ctl:
        recorder.attach(ctl)
        stats.attach(ctl)
        executors = LocalExecutors(ctl, count, kind=kind, tags=tags, code=code)
        executors.start()
        try:
            runner = FlowRunner(ctl, plan, sim_costs=sim_costs)
            with Dashboard(ctl, stats=stats, console=console, enabled=dashboard,
                           title=f"flowkit run {flow.name}") as board:
                _run_steps(runner, steps, board, writer, stats)
        except FlowRunError as exc:
            raise click.ClickException(str(exc)) from None
        finally:
            ctl.shutdown()
            executors.stop()
            if writer is not None:
                writer.close()
            if trace is not None:
                recorder.write_chrome(trace)
                console.print(f"wrote {trace} (open it in https://ui.perfetto.dev)")
    console.print(f"{flow.name}: {steps} step{'s' * (steps > 1)} done")


def _run_steps(runner: FlowRunner, steps: int, board: Dashboard, writer: MetricsWriter | None,
               stats: RunStats) -> None:
    for step in range(steps):
        board.set_status(f"step {step + 1}/{steps}")
        report = runner.run_step(step)
        record = _step_record(report, stats)
        board.set_metrics({k: v for k, v in record.items()
                           if k.endswith(("loss", "bubble_rate")) or k == "step_s"})
        if writer is not None:
            writer.write(record)


def _step_record(report: StepReport, stats: RunStats) -> dict:
    record = {"step": report.step, "step_s": report.elapsed_s, **report.metrics}
    record.update({f"timing_s/{name}": seconds for name, seconds in report.timing_s.items()})
    tokens = sum(v for k, v in report.metrics.items() if k.endswith("/tokens"))
    if tokens:
        record["tokens_per_s"] = tokens / report.elapsed_s
    losses = [v for k, v in report.metrics.items() if k.endswith("/loss")]
    if losses:
        record["loss"] = losses[0]
    snapshot = stats.snapshot().summary()
    record["perf/ops_per_s"] = snapshot.get("perf/ops_per_s")
    return record
