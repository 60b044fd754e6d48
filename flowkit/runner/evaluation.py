"""A flow's evaluation between steps (`flowkit run --eval-every K`): its `evaluation` flow run on
the run's own executors after every K steps, its `eval/...` metrics in that step's line.

The evaluation flow samples with the weights the executors hold: after a step, the newest, which
the step's optimizer step synced to every executor that generates with them before the step
ended. It runs as its own step 0 each time, so its prompts and sampling seeds are the same at
every evaluation and the curve compares like with like. In an asynchronous run the steps
already generating ahead go on while it runs (their calls wait in their own runner's queue),
but the next step's training starts after it.
"""

from __future__ import annotations

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
    none, or when it trains."""

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
