"""The body of `flowkit run`: start executors, run the steps, observe, report."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import attrs
import click
from rich.console import Console

from flowkit.cli._checkpoints import Checkpointing, GracefulStop, resume_point
from flowkit.cli._restarts import Restarts, temporary_checkpoints
from flowkit.dsl import Flow
from flowkit.observe import Dashboard, RunStats, TraceRecorder
from flowkit.observe.loggers import LoggerError, Loggers
from flowkit.observe.logsetup import LogSetup
from flowkit.ops import LOSSES, LOWERED_OPS
from flowkit.planner.lower import Call, NodePlan, lower_flow
from flowkit.planner.simcosts import SimCosts
from flowkit.runner.checkpoint import CheckpointError, flow_identity, restore
from flowkit.runner.flowrun import FlowRunError, FlowRunner, StepReport, check_async
from flowkit.runtime import Controller, RemoteError
from flowkit.runtime.futures import ExecutorLost
from flowkit.runtime.launch import LaunchError
from flowkit.runtime.launchers import make_launcher

__all__ = ["choose_executors", "executor_tags", "run_flow", "sparkline", "with_training_options"]


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


def choose_executors(flow: Flow, kind: str) -> str:
    """`auto`: torch executors, which must implement every model op of the flow; the timed
    simulator runs only when asked for (`--executors sim`), never as a silent stand-in."""
    if kind != "auto":
        return kind
    plan = lower_flow(flow)
    wanted = {need for node in plan if node.model is not None
              for need in LOWERED_OPS.get(node.call.value, (node.op,))}
    if not wanted:
        return "base"
    from executors.kinds import op_table

    missing = sorted(wanted - set(op_table("torch").names()))
    missing += sorted({f"the {node.config.get('loss')!r} loss" for node in plan
                       if node.call is Call.PIPELINE
                       and node.config.get("loss", "lm") not in LOSSES})
    if missing:
        raise click.ClickException(
            f"the torch executors do not implement {', '.join(missing)}: give the flow ops "
            "they implement, or run it on the timed simulator with --executors sim")
    click.echo("executors: torch (it implements every model op of this flow)", err=True)
    return "torch"


def with_training_options(flow: Flow, *, stages: int | None, microbatches: int | None,
                          schedule: str | None) -> Flow:
    """The flow with every trained model cut into `stages` and every backprop run with
    `microbatches` under `schedule`, where given."""
    trained = {node.model for node in flow.nodes.values()
               if getattr(node.operator, "lowering", None) == "pipeline"}
    for name in trained:
        if stages is not None:
            flow.models[name] = attrs.evolve(flow.models[name], stages=stages)
    for node in flow.nodes.values():
        if getattr(node.operator, "lowering", None) != "pipeline":
            continue
        if microbatches is not None:
            node.config["microbatches"] = microbatches
        if schedule is not None:
            node.config["schedule"] = schedule
    if schedule is not None:
        from flowkit.planner.schedules.registry import get_spec

        try:  # an unknown name fails here, before any executor starts
            get_spec(schedule)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--schedule") from None
    flow.validate()
    return flow


def run_flow(flow: Flow, *, code: list[str], kind: str, count: int | None,
             tag_spec: str | None, steps: int, sim_costs: SimCosts | None,
             trace: Path | None, dashboard: bool | None, logs: LogSetup | None = None,
             device: str = "cpu", fuse: bool = True, save_weights: Path | None = None,
             debug: bool = False, checkpoints: Checkpointing | None = None,
             resume: Path | None = None, staleness: int | None = None,
             max_restarts: int = 0, controller: dict | None = None,
             launcher: str = "local", launcher_settings: Any = None) -> None:
    """Run `steps` steps of `flow` (with `resume`, the steps after the checkpoint's up to
    `steps` in all), writing `checkpoints` as they say; asynchronously with a `staleness`
    bound [Note: asynchronous steps in flowkit/runner/flowrun.py]. The executors are started
    by `launcher` (flowkit/runtime/launchers.py) with its `launcher_settings`."""
    plan = lower_flow(flow)
    if staleness is not None:
        try:  # before any executor starts
            check_async(plan, staleness)
        except FlowRunError as exc:
            raise click.ClickException(f"--async: {exc}") from None
    stages = max((node.model.stages for node in plan if node.model is not None), default=1)
    count = count or max(2, stages)
    tags = executor_tags(plan, count, tag_spec)
    identity = flow_identity(flow.name, plan)
    resumed = None
    if resume is not None:  # checked before any executor starts
        layout = [{"name": f"exec-{i}", "tags": sorted(t), "kind": kind}
                  for i, t in enumerate(tags)]
        resumed = resume_point(resume, identity, sorted(layout, key=lambda e: e["name"]),
                               staleness)
    loggers = _open_loggers(logs or LogSetup(), flow.name, checkpoints, resumed)
    cleanup = None
    if max_restarts and checkpoints is None:  # restarts reload the newest checkpoint
        root, cleanup = temporary_checkpoints()
        checkpoints = Checkpointing(root=root, every=1, keep=1)
    if checkpoints is not None:
        checkpoints.identity, checkpoints.kind = identity, kind
    console = Console(stderr=False)
    recorder = TraceRecorder()
    stats = RunStats()
    run = _Run(steps=steps, loggers=loggers, stats=stats, checkpoints=checkpoints)
    # bind, keys, insecure: run.py's options; the loggers close however the run ends
    with loggers, Controller(**(controller or {})) as ctl:
        recorder.attach(ctl)
        stats.attach(ctl)
        executors = make_launcher(launcher, ctl, count, kind=kind, tags=tags, code=code,
                                  device=device, settings=launcher_settings)
        try:
            started = executors.start()
        except LaunchError as exc:  # e.g. Ray cannot place the executors
            raise click.ClickException(str(exc)) from None
        try:
            def make_runner() -> FlowRunner:
                return FlowRunner(ctl, plan, sim_costs=sim_costs, fuse=fuse,
                                  staleness=staleness, steps=steps)

            runner = make_runner()
            run.executors = started
            if max_restarts:
                run.restarts = Restarts(allowed=max_restarts, launcher=executors,
                                        make_runner=make_runner,
                                        names=frozenset(e.name for e in started))
            if resumed is not None:
                run.resume(runner, *resumed, console)
            with Dashboard(ctl, stats=stats, console=console, enabled=dashboard,
                           title=f"flowkit run {flow.name}") as board:
                done = run.steps_until_stopped(runner, board, console)
            runner = run.runner  # a restart replaces it
            if done < steps:
                console.print(f"{flow.name}: interrupted at step {done}")
            if cleanup is None and checkpoints is not None and checkpoints.written is not None:
                console.print(f"checkpoint of step {checkpoints.written} in {checkpoints.root}")
            if save_weights is not None:
                for path in runner.save_weights(save_weights):
                    console.print(f"wrote {path}")
        except (FlowRunError, CheckpointError, ExecutorLost) as exc:
            raise click.ClickException(_error_line(exc, debug)) from None
        finally:
            ctl.shutdown()
            executors.stop()
            if cleanup is not None:
                cleanup()
            if trace is not None:
                recorder.write_chrome(trace)
                console.print(f"wrote {trace} (open it in https://ui.perfetto.dev)")
    if done < steps:
        raise click.exceptions.Exit(130)  # the shell's code for a run stopped by Ctrl-C
    console.print(f"{flow.name}: {steps} step{'s' * (steps > 1)} done")


@attrs.define(kw_only=True)
class _Run:
    """The steps of one `flowkit run`, their metrics lines and checkpoints."""

    steps: int
    loggers: Loggers  # where each step's metrics go
    stats: RunStats
    checkpoints: Checkpointing | None
    first: int = 0  # the step to start with: after a resumed checkpoint's
    records: list[dict] = attrs.field(factory=list)  # every step's metrics line, as written
    executors: list = attrs.field(factory=list)
    restarts: Restarts | None = None  # --max-restarts [Note: executor restarts]
    runner: Any = None  # the one running: a restart makes a new one

    def resume(self, runner: FlowRunner, folder: Path, manifest: Any, console: Console) -> None:
        """Go on from `folder`: the executors' and runner's state, and the loggers rewound
        to the checkpoint's step, so the steps after it do not duplicate the ones an
        interrupted run logged past it [Note: loggers on resume]."""
        state = restore(folder, runner, self.executors)
        self.first, self.records = state.step, list(state.records)
        self.loggers.rewind(state.step, self.records)
        console.print(f"resumed from {folder} (step {state.step} of {self.steps})")

    def steps_until_stopped(self, runner: FlowRunner, board: Dashboard,
                            console: Console) -> int:
        """The steps done: all of them, or those before a Ctrl-C, which stops the run cleanly
        (what was asked to be written still is, and the executors are shut down). With
        checkpoints, the first Ctrl-C finishes the step and checkpoints it [GracefulStop].
        With restarts, a step that lost executors is replayed [Note: executor restarts]."""
        self.runner = runner
        stop = GracefulStop(self.checkpoints is not None, on_request=lambda: board.set_status(
            "Ctrl-C: finishing the step to checkpoint it (Ctrl-C again stops at once)"))
        try:
            with stop:
                step, first = self.first, self.restarts is not None
                while step < self.steps:
                    board.set_status(f"step {step + 1}/{self.steps}"
                                     f"{_ahead(self.runner, step)}")
                    try:
                        if first:  # what a failure in the first step goes back to
                            self._checkpoint(step, board)
                            first = False
                        self._step(self.runner, step, board)
                        done = step + 1
                        if self.checkpoints is not None and (self.checkpoints.due(done)
                                                             or stop.requested):
                            self._checkpoint(done, board)
                    except (FlowRunError, CheckpointError, ExecutorLost) as exc:
                        step = self._recover(exc, board, console)
                        continue
                    if stop.requested:
                        return done
                    step = done
        except KeyboardInterrupt:
            return self.runner.step
        return self.steps

    def _checkpoint(self, done: int, board: Dashboard) -> None:
        path = self.checkpoints.write(self.runner, self.executors, self.records, done)
        board.set_status(f"step {done}/{self.steps}: wrote {path}")

    def _recover(self, error: BaseException, board: Dashboard, console: Console) -> int:
        """The step to go on with after `error`, once lost executors are replaced and the
        newest checkpoint restored; `error` again when restarts cannot help."""
        while True:  # an executor may be lost again while the run recovers
            recovered = None if self.restarts is None else self.restarts.recover(
                error, self.checkpoints.root, board.warn)
            if recovered is None:
                raise error
            try:
                self.runner, self.executors, folder = recovered
                self.resume(self.runner, folder, None, console)
                return self.first
            except (RuntimeError, TimeoutError) as again:  # CheckpointError, ExecutorLost too
                error = again

    def _step(self, runner: FlowRunner, step: int, board: Dashboard) -> None:
        report = runner.run_step(step)
        for warning in report.warnings:
            board.warn(warning)
        record = {"time": time.time(), **_step_record(report, self.stats)}
        if self.restarts is not None:
            record["restarts"] = self.restarts.used
        self.records.append(record)
        board.set_metrics(_shown(record, self.records))
        self.loggers.log(step, record)


def _open_loggers(logs: LogSetup, name: str, checkpoints: Checkpointing | None,
                  resumed: tuple[Path, Any] | None) -> Loggers:
    """The run's loggers, opened before any executor starts: a missing extra is one error."""
    try:
        return logs.open(name=name, resume=None if resumed is None else resumed[0].parent,
                         checkpoints=None if checkpoints is None else checkpoints.root)
    except LoggerError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:  # the metrics file or the log dir: name which
        raise click.ClickException(f"cannot write {exc.filename or logs.log_dir}: "
                                   f"{exc.strerror or exc}") from None


def _ahead(runner: FlowRunner, step: int) -> str:
    """An asynchronous run's steps that may generate while `step` trains."""
    if not runner.staleness:
        return ""
    last = step + runner.staleness
    if runner.steps is not None:
        last = min(last, runner.steps - 1)
    return f" · generating up to step {last + 1}" if last > step else ""


def _shown(record: dict, records: list[dict]) -> dict:
    shown = {k: v for k, v in record.items()
             if k.endswith(("loss", "bubble_rate")) or k.startswith(("timing_s/", "reward"))
             or k in ("step_s", "tokens_per_s", "response_length_mean", "staleness/mean",
                      "staleness/max", "rollout/carried_over")}
    for key in ("loss", "reward_mean"):  # RL flows show their reward, all their loss
        values = [r[key] for r in records if r.get(key) is not None]
        if key in record and values:
            shown[f"{key} so far"] = f"{values[0]:.3g} → {values[-1]:.3g} {sparkline(values)}"
    return shown


def _error_line(error: FlowRunError, debug: bool) -> str:
    """What failed and why; the op's remote traceback only with --debug."""
    text, found, _ = str(error).partition(RemoteError.MARK)
    return str(error) if debug or not found else f"{text} (--debug shows the traceback)"


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


_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 40) -> str:
    """The last `width` values as bars, lowest ▁ to highest █: a loss curve in one line."""
    values = values[-width:]
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(_BARS[min(7, int((v - low) / span * 8))] for v in values)
