"""The runner: running a flow's steps on a controller's executors. `run(flow, RunConfig(...))`
and `Run` (api.py) are the public way in; RunConfig and its records are in config.py.

- flowrun.py: a flow's steps, node by node as the lowering says; steprun.py: one step's progress
  (stepstate.py: its items; stepbatching.py, steplending.py, stepreport.py: its batched calls,
  its scoring lent to bubbles, its report), given the run's submission.py (what its calls go out
  through) and feedback.py (what earlier steps fed back, and the admission gate); model_training.py:
  a trained model's pipeline, optimizer step, weight sync (feeding.py: its microbatches;
  trainschedule.py: its schedules; training_tasks.py: what each of those tasks is told; pipeline.py:
  a pipeline schedule as tasks; balance.py: stages by cost); partial.py: calls carried between
  steps that overlap.
- steploop.py: the steps one after the other with metrics, checkpoints and restarts;
  checkpoints/: a run's state on disk, when to write it, the open steps it holds, and lost
  executors replaced; setup.py: what a run decides before anything starts.
"""

from flowkit.observe.logsetup import LogSetup
from flowkit.runner.api import Run, RunResult, run
from flowkit.runner.config import (
    CheckpointConfig,
    ControllerConfig,
    RunConfig,
    RunConfigError,
    RunError,
)

__all__ = ["CheckpointConfig", "ControllerConfig", "LogSetup", "Run", "RunConfig",
           "RunConfigError", "RunError", "RunResult", "run"]
