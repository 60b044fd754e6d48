"""A run's checkpoints [Note: run checkpoints in flowkit/runner/checkpoints/format.py]: when to
write one, what to check before resuming, and Ctrl-C that finishes the step and checkpoints."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from flowkit.runner.checkpoints.format import (
    Manifest,
    latest_checkpoint,
    read_manifest,
    verify_files,
)
from flowkit.runner.checkpoints.restore import check_resumable
from flowkit.runner.checkpoints.writer import (
    PendingCheckpoint,
    begin_checkpoint,
    write_checkpoint,
)

__all__ = ["Checkpointing", "GracefulStop", "resume_point"]


@attrs.define(kw_only=True)
class Checkpointing:
    """Where and how often a run checkpoints, and what it knows to write one."""

    root: Path
    every: int | None  # steps between checkpoints; None: only on Ctrl-C
    keep: int = 2
    identity: dict = attrs.field(factory=dict)
    kind: str = "torch"
    run_id: str = ""  # the run's [Note: run checkpoints]: its folders are the only ones it prunes
    written: int | None = None  # the step count of the newest checkpoint written

    # begun, not finished yet, in order [Note: checkpoints that do not drain in
    # flowkit/runner/checkpoints/writer.py]
    pending: list[PendingCheckpoint] = attrs.field(factory=list)
    _watcher: Any = None  # the runner's watcher that finishes them
    _watched: Any = None  # that runner

    def due(self, done: int) -> bool:
        return self.every is not None and done % self.every == 0

    def write(self, runner: Any, executors: list, records: list[dict], done: int) -> Path:
        """The checkpoint of `done` steps, those begun before it first; CheckpointError when
        it cannot be written (an executor lost meanwhile: a restart may recover)."""
        finished = self.finish_pending(runner)
        if done in finished:  # begun at its boundary already (a Ctrl-C right after it)
            return finished[done]
        folder = write_checkpoint(self.root, runner, step=done, identity=self.identity,
                                  executors=executors, kind=self.kind, records=records,
                                  keep=self.keep, run_id=self.run_id)
        self.written = done
        return folder

    def begin(self, runner: Any, executors: list, records: list[dict], done: int,
              on_written: Callable[[Path], Any]) -> None:
        """Begin the checkpoint of `done` steps of an asynchronous run; it finishes while the
        run goes on, once the steps open now have generated (`on_written` is told its folder)
        [Note: checkpoints that do not drain in flowkit/runner/checkpoints/writer.py]."""
        self.pending.append(begin_checkpoint(
            self.root, runner, step=done, identity=self.identity, executors=executors,
            kind=self.kind, records=records, keep=self.keep, run_id=self.run_id))
        if self._watcher is None:
            self._watcher = lambda: self._finish_ready(runner, on_written)
            self._watched = runner
            runner.watchers.append(self._watcher)

    def _finish_ready(self, runner: Any, on_written: Callable[[Path], Any]) -> None:
        while self.pending and self.pending[0].ready(runner):
            pending = self.pending.pop(0)
            on_written(pending.finish(runner))
            self.written = pending.step
        if not self.pending:
            self._unwatch(runner)

    def finish_pending(self, runner: Any) -> dict[int, Path]:
        """Finish the checkpoints begun, waiting for what they wait for; their folders by
        step."""
        self._unwatch(runner)  # none finishes twice: here only
        finished = {}
        while self.pending:
            finished[self.pending[0].step] = self.pending[0].wait(runner)
            self.written = self.pending.pop(0).step
        return finished

    def _unwatch(self, runner: Any) -> None:
        watched = self._watched if self._watched is not None else runner
        if self._watcher is not None and self._watcher in watched.watchers:
            watched.watchers.remove(self._watcher)
        self._watcher = self._watched = None

    def discard(self) -> None:
        """Give up the checkpoints begun (the run failed or stops at once)."""
        for pending in self.pending:
            pending.discard()
        self.pending.clear()
        self._unwatch(self._watched)


def resume_point(path: Path, identity: dict, layout: list[dict],
                 staleness: int | None = None,
                 replicas: dict[str, int] | None = None) -> tuple[Path, Manifest]:
    """The checkpoint `--resume path` names, checked against this run (of that staleness
    bound) before any executor starts; a CheckpointError naming the mismatch otherwise."""
    folder = latest_checkpoint(path)
    manifest = read_manifest(folder)
    check_resumable(manifest, identity, layout, folder, staleness, replicas)
    verify_files(folder, manifest)
    return folder, manifest


class GracefulStop:
    """With run checkpoints, the first Ctrl-C lets the running step finish, so that a checkpoint
    of it can be written before the run exits; a second one stops at once (KeyboardInterrupt,
    as without checkpoints). Only the main thread can own signals: elsewhere this does
    nothing."""

    def __init__(self, enabled: bool, on_request: Any = None) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested = False
        self.on_request = on_request
        self._previous: Any = None

    def __enter__(self) -> GracefulStop:
        if self.enabled:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, self._previous)  # the next Ctrl-C interrupts
        if self.on_request is not None:
            self.on_request()
