"""A run's steps one after the other: each step's metrics line to the loggers and the dashboard,
checkpoints when due, Ctrl-C that finishes the step first, and restarts after lost executors."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

from flowkit.observe import Dashboard, RunStats
from flowkit.observe.loggers import Loggers
from flowkit.runner.checkpoints.format import CheckpointError, latest_checkpoint
from flowkit.runner.checkpoints.policy import Checkpointing, GracefulStop
from flowkit.runner.checkpoints.restarts import Restarts
from flowkit.runner.checkpoints.restore import restore
from flowkit.runner.evaluation import Evaluation
from flowkit.runner.flowrun import FlowRunError, FlowRunner, StepReport
from flowkit.runtime.futures import ExecutorLost

__all__ = ["StepLoop"]

# what a step may fail with that restarts can recover from (or that ends the run)
STEP_FAILURES = (FlowRunError, CheckpointError, ExecutorLost)


@attrs.define(kw_only=True)
class StepLoop:
    """The steps of one run, their metrics lines and checkpoints."""

    steps: int
    loggers: Loggers  # where each step's metrics go
    stats: RunStats
    checkpoints: Checkpointing | None
    say: Callable[[str], None]  # a line for the user
    first: int = 0  # the step to start with: after a resumed checkpoint's
    records: list[dict] = attrs.field(factory=list)  # every step's metrics line, as written
    executors: list = attrs.field(factory=list)
    restarts: Restarts | None = None  # [Note: executor restarts]
    runner: Any = None  # the one running: a restart makes a new one
    stopped: bool = False  # by Ctrl-C, before the last step
    completed: int = 0  # the steps done, a resumed checkpoint's included
    origin: Path | None = None  # the --resume'd checkpoint: where a restart with none newer goes
    # what a checkpoint read back may hold: record classes by path (state_codec.allowed_records),
    # and the models executors build, the flow's specs by name (format.flow_models)
    allowed_records: dict = attrs.field(factory=dict)
    models: dict = attrs.field(factory=dict)
    evaluation: Evaluation | None = None  # run after every few steps (--eval-every)

    def resume(self, runner: FlowRunner, folder: Path) -> None:
        """Go on from `folder`: the executors' and runner's state, and the loggers rewound
        to the checkpoint's step, so the steps after it do not duplicate the ones an
        interrupted run logged past it [Note: loggers on resume]."""
        state = restore(folder, runner.checkpoints, self.executors, records=self.allowed_records,
                        models=self.models)
        if self.origin is None:
            self.origin = folder
        self.first, self.records = state.step, list(state.records)
        self.completed = state.step
        self.loggers.rewind(state.step, self.records)
        self.say(f"resumed from {folder} (step {state.step} of {self.steps})")

    def run(self, runner: FlowRunner, board: Dashboard) -> Iterator[StepReport]:
        """Each step's report as it ends: all of them, or those before a Ctrl-C, which stops
        the run cleanly (what was asked to be written still is, and the executors are shut
        down). With checkpoints, the first Ctrl-C finishes the step and checkpoints it
        [GracefulStop]. With restarts, a step that lost executors is replayed [Note: executor
        restarts]."""
        self.runner = runner
        stop = GracefulStop(self.checkpoints is not None, on_request=lambda: board.set_status(
            "Ctrl-C: finishing the step to checkpoint it (Ctrl-C again stops at once)"))
        try:
            with stop:
                # a second call goes on where the first stopped (after a `break`)
                step, first = self.completed, self.restarts is not None and not self.records
                while step < self.steps:
                    board.set_status(f"step {step + 1}/{self.steps}{_ahead(self.runner, step)}")
                    try:
                        if first:  # what a failure in the first step goes back to
                            self._checkpoint(step, board)
                            first = False
                        report = self._step(self.runner, step, board)
                        done = step + 1
                        if self.checkpoints is not None and (self.checkpoints.due(done)
                                                             or stop.requested):
                            self._checkpoint(done, board, later=not stop.requested)
                            self._grow(done, board)
                        if done == self.steps and self.checkpoints is not None:
                            self.checkpoints.finish_pending(self.runner.checkpoints)
                    except STEP_FAILURES as exc:
                        step = self._recover(exc, board)
                        continue
                    self.completed = done
                    yield report
                    if stop.requested:  # maybe during the caller's work on the report
                        if self.checkpoints is not None and self.checkpoints.written != done:
                            self._checkpoint(done, board)
                        self.stopped = done < self.steps
                        return
                    step = done
        except KeyboardInterrupt:
            self.stopped, self.completed = True, self.runner.step
            if self.checkpoints is not None:
                self.checkpoints.discard()

    def _checkpoint(self, done: int, board: Dashboard, later: bool = False) -> None:
        """The checkpoint of `done` steps; `later`: an asynchronous run's may finish while the run
        goes on [Note: checkpoints that do not drain in flowkit/runner/checkpoints/writer.py],
        unless it is the run's last."""
        if self.evaluation is not None:  # no evaluation's calls on the engines it snapshots
            self.evaluation.join()
        if later and self.runner.staleness is not None and done < self.steps:
            self.checkpoints.begin(self.runner.checkpoints, self.executors, self.records, done,
                                   lambda path: board.set_status(f"wrote {path}"))
            return
        path = self.checkpoints.write(self.runner.checkpoints, self.executors, self.records, done)
        board.set_status(f"step {done}/{self.steps}: wrote {path}")

    def _grow(self, done: int, board: Dashboard) -> None:
        """Executors that joined an elastic run that shrank: it goes on from the checkpoint of
        `done` steps just written, on a larger layout [Note: elastic runs in
        flowkit/runner/elastic.py]. Only once that checkpoint is complete."""
        if self.restarts is None or self.checkpoints.written != done or done == self.steps:
            return
        grown = self.restarts.grow(board.warn)
        if grown is not None:
            self.runner, self.executors = grown
            self.resume(self.runner, latest_checkpoint(self.checkpoints.root))

    def _recover(self, error: BaseException, board: Dashboard) -> int:
        """The step to go on with after `error`, once lost executors are replaced and the
        newest checkpoint restored; `error` again when restarts cannot help."""
        if self.evaluation is not None:  # it ran on the executors the restart replaces
            self.evaluation.discard()
        if self.checkpoints is not None:  # their open steps are lost with the runner
            self.checkpoints.discard()
        while True:  # an executor may be lost again while the run recovers
            recovered = None if self.restarts is None else self.restarts.recover(
                error, self.checkpoints.root, board.warn, origin=self.origin)
            if recovered is None:
                raise error
            try:
                self.runner, self.executors, folder = recovered
                if folder is None:  # lost before any checkpoint: every executor is new
                    self.first, self.completed = 0, 0
                    return 0
                self.resume(self.runner, folder)
                return self.first
            except (RuntimeError, TimeoutError) as again:  # CheckpointError, ExecutorLost too
                error = again

    def _step(self, runner: FlowRunner, step: int, board: Dashboard) -> StepReport:
        report = runner.run_step(step)
        for warning in report.warnings:
            board.warn(warning)
        if self.evaluation is not None:
            report.metrics.update(self._evaluate(runner, step, board))
        record = {"time": time.time(), **self.stats.step_line(report)}
        if self.restarts is not None:
            record["restarts"] = self.restarts.used
            if self.restarts.elastic is not None:  # [Note: elastic runs]
                record["shrinks"] = self.restarts.elastic.shrinks
                record["grows"] = self.restarts.elastic.grows
        self.records.append(record)
        board.show_step(record, self.records)
        self.loggers.log(step, record)
        return report

    def _evaluate(self, runner: FlowRunner, step: int, board: Dashboard) -> dict:
        """The evaluation metrics for step `step`'s line [Note: evaluation during training
        in evaluation.py]: the one that ran alongside this step, and this step's own when it
        is due: run now when the run is synchronous (or this is its last step), else started
        alongside the next step, whose line gets them."""
        evaluation = self.evaluation
        metrics = evaluation.wait()  # ended already where the step synced weights
        if not evaluation.due(step):
            return metrics
        if not runner.staleness or evaluation.every == 1 or step == self.steps - 1:
            board.set_status(f"step {step + 1}/{self.steps}: evaluating")
            return {**metrics, **evaluation.run(runner.ctl), "eval/step": step}
        for training in runner.training.values():  # the next weights wait for it
            training.before_sync = evaluation.join
        evaluation.start(runner.ctl, step)
        return metrics


def _ahead(runner: FlowRunner, step: int) -> str:
    """An asynchronous run's steps that may generate while `step` trains."""
    if not runner.staleness:
        return ""
    last = step + runner.staleness
    if runner.steps is not None:
        last = min(last, runner.steps - 1)
    return f" · generating up to step {last + 1}" if last > step else ""
