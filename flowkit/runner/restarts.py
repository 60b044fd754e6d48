"""A run that survives lost executors (`RunConfig.max_restarts`, `flowkit run --max-restarts N`).

The design: [Note: executor restarts] below.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from flowkit.runner.checkpoint import CheckpointError, latest_checkpoint
from flowkit.runtime.launch import Launcher

__all__ = ["Restarts", "temporary_checkpoints"]


# [Note: executor restarts] With restarts allowed, the run checkpoints before its first step and
# after every step (into --checkpoint-dir, or a temporary folder), [Note: run checkpoints] in
# flowkit/runner/checkpoint.py. When a step fails because executors were lost (a process killed, out
# of memory, its host gone: the controller fails their tasks at once, or at the heartbeat timeout),
# the run
#   1. waits for the other executors' tasks to end (those that needed the lost ones' outputs were
#      cancelled), so nothing changes their state behind the reload;
#   2. starts a new process for each lost executor, with its name, tags and device;
#   3. builds a fresh runner (the models land on the same executors: placement is by name) and
#      restores every executor and the runner from the newest checkpoint, as `--resume` does: the
#      survivors drop whatever the failed step did to their weights and optimizer states;
#   4. replays the steps from that checkpoint on. A synchronous step is a function of the
#      checkpointed state, so the run ends with the parameters and the curve of a run without
#      faults. An asynchronous run's checkpoint also holds the rollouts of its open steps ([Note:
#      checkpoints of asynchronous runs] in flowkit/runner/asyncstate.py): a lost executor's
#      generation in flight is replayed from it, no sample lost or trained twice, within the
#      staleness bound; where generation under the same weights versions is deterministic (the
#      simulator) the run ends with the curve of a run without faults, on torch the versions of
#      later steps' tokens depend on timing, as in any two runs. Each restart is a warning on the
#      dashboard and counts in the metrics (`restarts`); past N restarts, or when no executor was
#      lost, the step's error ends the run as without restarts.

_QUIESCE_S = 120.0  # the survivors' tasks of the failed step: generation may have a long tail


@attrs.define(kw_only=True)
class Restarts:
    """What a run needs to replace lost executors and go on [Note: executor restarts]."""

    allowed: int
    launcher: Launcher  # replace(names) starts the lost executors again
    make_runner: Callable[[], Any]
    used: int = 0
    names: frozenset = frozenset()  # the run's executors

    def lost(self) -> list[str]:
        alive = {e.name for e in self.launcher.controller.executors()}
        return sorted(self.names - alive)

    def recover(self, error: BaseException, root: Path, warn: Callable[[str], None]
                ) -> tuple[Any, list, Path] | None:
        """(a fresh runner, every executor, the checkpoint to restore) after `error`, or None
        when it is not a loss this run may recover from."""
        lost = self.lost()
        if not lost or self.used >= self.allowed:
            return None
        try:
            folder = latest_checkpoint(root)
        except CheckpointError:  # lost before the first checkpoint was complete
            return None
        self.used += 1
        reason = str(error).splitlines()[0]
        warn(f"{', '.join(lost)} lost ({reason}); restart {self.used} of {self.allowed}: a new "
             f"process takes its place and the run goes on from {folder.name}")
        try:
            self.launcher.controller.quiesce(_QUIESCE_S)
            executors = self.launcher.replace(lost)
        except (RuntimeError, TimeoutError) as again:  # lost again meanwhile: another restart
            return self.recover(again, root, warn)
        return self.make_runner(), executors, folder


def temporary_checkpoints() -> tuple[Path, Callable[[], None]]:
    """A folder for the checkpoints restarts need when the run keeps none, and its removal."""
    root = Path(tempfile.mkdtemp(prefix="flowkit-restarts-"))
    return root, lambda: shutil.rmtree(root, ignore_errors=True)
