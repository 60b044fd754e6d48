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

from flowkit.runner.checkpoints.format import CheckpointError, latest_checkpoint
from flowkit.runtime.launch import ExecutorExited, Launcher
from flowkit.runtime.registry import ExecutorInfo

__all__ = ["Restarts", "start_executors", "temporary_checkpoints"]


# [Note: executor restarts] With restarts allowed, the run checkpoints before its first step and
# after every step ([Note: run checkpoints] in flowkit/runner/checkpoints/format.py). When a step
# fails because executors were lost (killed, out of memory, host gone: their tasks fail at once or
# at the heartbeat timeout), the run waits for the other executors' tasks to end, so nothing
# changes their state behind the reload; starts a new process for each lost one with its name,
# tags and device; builds a fresh runner and restores every executor from the newest checkpoint,
# as `--resume` does; and replays from there. Why it gives the faultless run: a synchronous step
# is a function of the checkpointed state; an asynchronous checkpoint also holds its open steps'
# rollouts ([Note: checkpoints of asynchronous runs] in
# flowkit/runner/checkpoints/open_steps.py), so no sample is lost or trained twice. Each restart
# counts in `restarts`; past N, or with no executor lost, the error ends the run. A loss while
# executors or a replacement start restarts that one; one before the first checkpoint is complete
# starts every executor afresh from step 0. In full: docs/running-flows.md, "Lost executors".

_QUIESCE_S = 120.0  # the survivors' tasks of the failed step: generation may have a long tail


@attrs.define(kw_only=True)
class Restarts:
    """What a run needs to replace lost executors and go on [Note: executor restarts]."""

    allowed: int
    launcher: Launcher  # replace(names) starts the lost executors again
    make_runner: Callable[[], Any]
    used: int = 0
    names: frozenset = frozenset()  # the run's executors
    elastic: Any = None  # elastic.Elastic: past `allowed`, go on with those left

    def lost(self, error: BaseException | None = None) -> list[str]:
        """The run's executors that are gone: those the controller lost, and the one whose
        exit `error` reports (the controller may not have seen it yet)."""
        alive = {e.name for e in self.launcher.controller.executors()}
        gone = self.names - alive
        if isinstance(error, ExecutorExited):
            gone |= {error.name}
        return sorted(gone)

    def recover(self, error: BaseException, root: Path, warn: Callable[[str], None], *,
                origin: Path | None = None) -> tuple[Any, list, Path | None] | None:
        """(a fresh runner, every executor, the checkpoint to restore: None to start over)
        after `error`, or None when it is not a loss this run may recover from. With no
        checkpoint in `root` yet, a resumed run goes back to `origin`, what it resumed."""
        lost = self.lost(error)
        if not lost:
            return None
        try:
            folder: Path | None = latest_checkpoint(root)
        except CheckpointError:  # lost before the first checkpoint was complete
            folder = origin
        if self.used >= self.allowed:
            return self._shrink(lost, error, folder, root, warn, origin)
        self.used += 1
        reason = str(error).splitlines()[0]
        again = (f"the run goes on from {folder.name}" if folder is not None else
                 "no checkpoint is complete yet, so every executor starts afresh and the run "
                 "begins again")
        warn(f"{', '.join(lost)} lost ({reason}); restart {self.used} of {self.allowed}: a new "
             f"process takes its place and {again}")
        try:
            self.launcher.controller.quiesce(_QUIESCE_S)
            executors = self.launcher.replace(lost if folder is not None else sorted(self.names))
        except (RuntimeError, TimeoutError) as error_again:  # lost again: another restart
            return self.recover(error_again, root, warn, origin=origin)
        return self.make_runner(), executors, folder

    def _shrink(self, lost: list[str], error: BaseException, folder: Path | None, root: Path,
                warn: Callable[[str], None], origin: Path | None
                ) -> tuple[Any, list, Path] | None:
        """With no restart left, an elastic run goes on with the executors it has from the
        newest checkpoint [Note: elastic runs in flowkit/runner/elastic.py]; None otherwise."""
        if self.elastic is None or folder is None:
            return None
        reason = str(error).splitlines()[0]
        warn(f"{', '.join(lost)} lost ({reason}); no restart left: the run goes on from "
             f"{folder.name} with the executors it has")
        try:
            runner, executors = self.elastic.go_on(self.launcher.controller, len(self.names),
                                                   warn)
        except (RuntimeError, TimeoutError) as error_again:
            if len(self.lost(error_again)) <= len(lost):  # no new loss: it would fail again
                warn(f"the run cannot go on with the executors left: {error_again}")
                return None
            return self.recover(error_again, root, warn, origin=origin)  # lost more meanwhile
        self.names = frozenset(e.name for e in executors)
        return runner, executors, folder

    def grow(self, warn: Callable[[str], None]) -> tuple[Any, list] | None:
        """(a fresh runner, every executor) when executors joined an elastic run that shrank
        [Note: elastic runs in flowkit/runner/elastic.py]; None otherwise."""
        if self.elastic is None:
            return None
        grown = self.elastic.grow(self.launcher.controller, self.names, warn)
        if grown is not None:
            self.names = frozenset(e.name for e in grown[1])
        return grown



def start_executors(launcher: Launcher, allowed: int, warn: Callable[[str], None]
                    ) -> tuple[list[ExecutorInfo], int]:
    """The launcher's executors, started; one that exits while they start is started again,
    up to `allowed` times in all, each a restart [Note: executor restarts]. Returns the
    executors and the restarts used."""
    used = 0
    try:
        return launcher.start(), used
    except ExecutorExited as exited:
        error = exited
    while used < allowed:
        used += 1
        warn(f"{error}; restart {used} of {allowed}: a new process takes its place")
        try:
            return launcher.replace([error.name]), used
        except ExecutorExited as exited:
            error = exited
    raise error


def temporary_checkpoints() -> tuple[Path, Callable[[], None]]:
    """A folder for the checkpoints restarts need when the run keeps none, and its removal."""
    root = Path(tempfile.mkdtemp(prefix="flowkit-restarts-"))
    return root, lambda: shutil.rmtree(root, ignore_errors=True)
