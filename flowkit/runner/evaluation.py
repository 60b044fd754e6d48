"""A flow's evaluation between steps (`flowkit run --eval-every K`): its `evaluation` flow run on
the run's own executors after every K steps, its `eval/...` metrics in a step's line.

[Note: evaluation during training] The evaluation flow samples with the weights the executors
hold: after step s, the newest, which the step's optimizer step synced to every executor that
generates with them before the step ended. It runs as its own step 0 each time (a runner of its
own, on the run's controller), so its prompts and sampling seeds are the same at every
evaluation and the curve compares like with like.

A synchronous run evaluates between two steps and puts the metrics in step s's line. An
asynchronous run does not wait for it: the evaluation runs in a thread of its own alongside
step s+1 (its tasks and replies go through the controller like any runner's; its reactions run
in its own queue), and its metrics go in step s+1's line (every line that has them says which
step's weights with `eval/step`). So that it evaluates step s's weights only, step s+1's
weight sync waits for it to end, and so does step s+1's line where no weights are synced (the
simulator): training stalls only for an evaluation longer than a step. The last step's
evaluation runs before its own line, and so does every one with K = 1 (each line would
otherwise have two).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from flowkit.dsl import Flow
from flowkit.planner.lower import lower_flow
from flowkit.runner.config import RunConfigError
from flowkit.runner.flowrun import FlowRunner
from flowkit.runner.steprun import TRAINING_CALLS

__all__ = ["Evaluation"]

PREFIX = "eval/"  # the evaluation's own metrics; the rest of its step report stays out


class Evaluation:
    """`flow.evaluation` every `every` steps; refused before anything starts when the flow has
    none, or when it trains. [Note: evaluation during training]"""

    def __init__(self, flow: Flow, every: int, *, sim_costs: Any = None,
                 step_timeout: float = 600.0) -> None:
        evaluation = flow.evaluation
        if evaluation is None:
            raise RunConfigError("eval_every", f"flow {flow.name!r} declares no evaluation to "
                                 "run every few steps: give the RL flow eval_source=... (its "
                                 "held-out prompts; dataflows/rl/evaluation.py), or drop "
                                 "--eval-every")
        for name in evaluation.models:  # the run's own: --stages and --replicas re-cut them
            if name in flow.models:
                evaluation.models[name] = flow.models[name]
        self.plan = lower_flow(evaluation)
        training = [node.name for node in self.plan if node.call in TRAINING_CALLS]
        if training:
            raise RunConfigError("eval_every", f"the evaluation flow of {flow.name!r} trains "
                                 f"({', '.join(training)}): an evaluation only samples and "
                                 "scores")
        self.every = every
        self.sim_costs, self.step_timeout = sim_costs, step_timeout
        self._pending: _Background | None = None

    def due(self, step: int) -> bool:
        """Whether the evaluation runs after `step` (0-based): after steps K-1, 2K-1, ..."""
        return (step + 1) % self.every == 0

    def run(self, ctl: Any) -> dict[str, Any]:
        """The evaluation's metrics, with how long it took. A runner of its own each time, so
        executors a restart replaced are the ones it places on."""
        start = time.monotonic()
        runner = FlowRunner(ctl, self.plan, sim_costs=self.sim_costs,
                            step_timeout=self.step_timeout)
        report = runner.run_step(0)
        metrics = {key: value for key, value in report.metrics.items()
                   if key.startswith(PREFIX)}
        metrics[f"{PREFIX}seconds"] = time.monotonic() - start
        return metrics

    # -- alongside an asynchronous run ---------------------------------------------------------
    def start(self, ctl: Any, step: int) -> None:
        """Evaluate the weights after `step` in a thread; `wait` collects it.
        One at a time: collect the one before first."""
        if self._pending is not None:
            raise RuntimeError("an evaluation still runs: wait() for it before starting one")
        self._pending = _Background(step, lambda: self.run(ctl))

    def join(self) -> None:
        """Wait for a background evaluation to end, keeping its metrics for `wait`."""
        if self._pending is not None:
            self._pending.thread.join()

    def discard(self) -> None:
        """Wait for a background evaluation to end and drop it, its error too: the run lost
        an executor and goes back to a checkpoint, whose next steps evaluate again."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.thread.join()

    def wait(self) -> dict[str, Any]:
        """Wait for a background evaluation to end; its metrics, with the step it evaluated
        (`eval/step`), or {} if none runs. Its error, if it failed, is raised here."""
        pending, self._pending = self._pending, None
        if pending is None:
            return {}
        pending.thread.join()
        if pending.error is not None:
            raise pending.error
        return {**pending.metrics, f"{PREFIX}step": pending.step}


class _Background:
    """One evaluation running in a thread."""

    def __init__(self, step: int, evaluate: Any) -> None:
        self.step = step
        self.metrics: dict[str, Any] = {}
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(evaluate,),
                                       name=f"flowkit-eval-{step}", daemon=True)
        self.thread.start()

    def _run(self, evaluate: Any) -> None:
        try:
            self.metrics = evaluate()
        except BaseException as exc:  # noqa: BLE001 - handed to the run's thread in wait()
            self.error = exc
