"""Writing a run checkpoint ([Note: run checkpoints in flowkit/runner/checkpoints/format.py]):
begun at a step boundary, finished once the open steps have generated, renamed in whole, the
oldest of the run pruned.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import time
from pathlib import Path
from typing import Any

import attrs

from flowkit.ops.executor_ops import STATE_OPS
from flowkit.runner.checkpoints.controller_state import MAX_RUN_STATE, RunState, state_bytes
from flowkit.runner.checkpoints.format import (
    MANIFEST,
    PREFIX,
    RUN_STATE,
    Checkpointed,
    Manifest,
    complete_checkpoints,
    executor_layout,
    run_of,
    run_record,
)
from flowkit.runner.checkpoints.open_steps import open_work
from flowkit.runner.checkpoints.state_codec import CheckpointError, write_private
from flowkit.runner.stepstate import RunnerState
from flowkit.runtime.registry import ExecutorInfo
from flowkit.wire.refs import Gather, Item

__all__ = ["PendingCheckpoint", "begin_checkpoint", "write_checkpoint"]




# -- writing ----------------------------------------------------------------------------------
# [Note: checkpoints that do not drain] An asynchronous run's checkpoint holds what its open
# steps generate ([Note: checkpoints of asynchronous runs] in open_steps.py), which is done only
# once their generating nodes have ended. Waiting for that at the boundary would stop training
# for the open steps' generation, so a checkpoint is begun at the boundary and finished later,
# while the run goes on (`begin_checkpoint`, `PendingCheckpoint`): at the boundary the executors
# save their states ahead of any task of the next step and the runner's part is copied
# (`FlowRunner.boundary`); after each burst of reactions the runner asks whether the states are
# written and the open steps' generation has ended, then fetches their outputs
# (`FlowRunner.open_state`), writes the run state and manifest and renames the folder in. The
# samples are the same whether the next step trained meanwhile or not (a sample keeps its tokens'
# versions). Checkpoints finish in order; the run's end and a Ctrl-C wait for theirs; a failure
# loses only unfinished ones. A synchronous boundary's checkpoint finishes as it begins.
# `flowkit bench checkpoint` measures the cost of one every step. In full: docs/running-flows.md,
# "Checkpoints of asynchronous runs".
def write_checkpoint(root: Path, runner: Checkpointed, *, step: int, identity: dict,
                     executors: list[ExecutorInfo], kind: str, records: list[dict], keep: int,
                     run_id: str, timeout: float = 600.0) -> Path:
    """Write the checkpoint of `runner` after `step` steps (a step boundary: nothing trains)
    under `root`, waiting for the open steps' generation, and keep the newest `keep` of run
    `run_id`; returns its folder."""
    pending = begin_checkpoint(root, runner, step=step, identity=identity,
                               executors=executors, kind=kind, records=records, keep=keep,
                               run_id=run_id, timeout=timeout)
    return pending.wait(runner)


def begin_checkpoint(root: Path, runner: Checkpointed, *, step: int, identity: dict,
                     executors: list[ExecutorInfo], kind: str, records: list[dict], keep: int,
                     run_id: str, timeout: float = 600.0) -> PendingCheckpoint:
    """Begin the checkpoint of `runner` after `step` steps, at the step boundary: the
    executors save their states and the runner's part is copied; it finishes once the open
    steps' generation has ended [Note: checkpoints that do not drain]."""
    root = Path(root).resolve()
    final = root / f"{PREFIX}{step:08d}"
    temp = root / f".{final.name}.tmp-{run_id}-{os.getpid()}"
    _private_dir(root, parents=True)
    shutil.rmtree(temp, ignore_errors=True)
    _private_dir(temp)
    _private_dir(temp / "executors")
    ctl = runner.ctl
    saving = [e for e in executors if all(op in e.ops for op in STATE_OPS)]
    saves = [ctl.submit("save_state", config={"path": str(temp / "executors" / e.name)},
                        executor=e.id, meta={"node": "checkpoint", "step": step})
             for e in saving]
    for future in saves:  # the runner looks at the checkpoint again once it is saved
        future.add_done_callback(lambda _: runner.events.put(_nothing))
    return PendingCheckpoint(
        root=root, final=final, temp=temp, step=step, identity=identity,
        layout=executor_layout(executors, kind), records=list(records), keep=keep,
        run_id=run_id, timeout=timeout, saves=saves, saved=[e.name for e in saving],
        boundary=runner.boundary(),
        open_runs=dict(runner.open), waiting=dict(runner.carried))


def _nothing() -> None:
    """A reaction that only wakes the runner."""


@attrs.define(kw_only=True, eq=False)
class PendingCheckpoint:
    """A checkpoint begun at a step boundary, finished once the open steps at that boundary
    have generated all they will [Note: checkpoints that do not drain]."""

    root: Path
    final: Path
    temp: Path
    step: int
    identity: dict
    layout: list[dict]
    records: list[dict]
    keep: int
    run_id: str
    timeout: float
    saves: list  # each executor's save_state future
    saved: list[str]  # the names of the executors of `saves`, in their order
    boundary: RunnerState  # the runner's part but the open steps', at the boundary
    open_runs: dict  # step -> the step's run, open at the boundary
    waiting: dict  # the ledger's carried calls at the boundary, for steps not open then
    started: float = attrs.field(factory=time.perf_counter)

    def ready(self, runner: Checkpointed) -> bool:
        """Whether every state is written and the open steps' generation has ended."""
        return all(future.done() for future in self.saves) and all(
            run.node_closed(name) for run in self.open_runs.values()
            for name in runner.generating)

    def wait(self, runner: Checkpointed) -> Path:
        """Run the open steps' reactions until it is ready, then finish it."""
        deadline = time.monotonic() + self.timeout
        while not self.ready(runner):
            try:
                runner.run_reactions(max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise CheckpointError(
                    f"the checkpoint of step {self.step} waited {self.timeout} s for "
                    f"{self._waiting_for(runner)}") from None
        return self.finish(runner)

    def _waiting_for(self, runner: Checkpointed) -> str:
        still = [f"{name} of step {step}" for step, run in sorted(self.open_runs.items())
                 for name in runner.generating if not run.node_closed(name)]
        saving = sum(1 for future in self.saves if not future.done())
        if saving:
            still.append(f"{saving} executor(s) saving their states")
        return "; ".join(still) or "nothing"

    def finish(self, runner: Checkpointed) -> Path:
        """Write the run state and the manifest, rename the folder in, prune; returns it. If
        that fails, its unfinished folder goes."""
        try:
            return self._finish(runner)
        except BaseException:
            self.discard()
            raise

    def _finish(self, runner: Checkpointed) -> Path:
        for future in self.saves:
            if future.exception() is not None:
                raise CheckpointError(f"checkpoint of step {self.step}: {future.exception()}")
        snapshot = attrs.evolve(self.boundary,
                                **runner.open_state(self.open_runs, self.waiting))
        ctl, temp, final = runner.ctl, self.temp, self.final
        work = None if snapshot.staleness is None else open_work(ctl, snapshot, self.timeout)
        state = RunState(step=self.step, records=self.records,
                         feedback={key: _value(ctl, ref)
                                   for key, ref in snapshot.feedback.items()},
                         training=snapshot.training, profiles=snapshot.profiles,
                         open_work=work)
        data = state_bytes(state)
        if len(data) > MAX_RUN_STATE:
            raise CheckpointError(f"checkpoint of step {self.step}: a run state of {len(data)} "
                                  f"bytes, more than the {MAX_RUN_STATE} a resume reads")
        write_private(temp / RUN_STATE, data)
        manifest = Manifest(step=self.step, identity=self.identity, executors=self.layout,
                            run=run_record(self.run_id, self.identity),
                            placement=snapshot.placement,
                            written_s=time.perf_counter() - self.started,
                            staleness=snapshot.staleness, files=self._checksums(data))
        write_private(temp / MANIFEST, json.dumps(attrs.asdict(manifest), indent=1).encode())
        if os.path.lexists(final):  # the same step again (a resumed run interrupted at once)
            _replaceable(final, self.run_id)
            shutil.rmtree(final)
        os.rename(temp, final)
        _fsync_dir(self.root)
        _prune(self.root, self.keep, self.run_id)
        return final

    def _checksums(self, run_state: bytes) -> dict[str, str]:
        """[Note: checkpoint checksums] Every file of a checkpoint has its SHA-256 in the
        manifest, taken as it was written (an executor hashes its state as it writes it, the
        controller the run state's bytes): a resume checks each file against it before any of
        it is parsed, and a file that differs is one line naming it. It finds a file damaged
        or changed since, not one forged with its manifest: whoever can write the folder can
        write both (docs/security.md). A checkpoint without checksums, written before them,
        still loads, with a warning (restore.py)."""
        files = {f"executors/{name}": future.result()["sha256"]
                 for name, future in zip(self.saved, self.saves, strict=True)}
        return {RUN_STATE: hashlib.sha256(run_state).hexdigest(), **files}

    def discard(self) -> None:
        """Give it up (the run failed or stops at once): its unfinished folder goes."""
        shutil.rmtree(self.temp, ignore_errors=True)


def _private_dir(path: Path, parents: bool = False) -> None:
    """`path` made a folder only its owner can enter (0700 whatever the umask); an existing
    root is left as its owner made it."""
    if parents and path.is_dir():
        return
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir(mode=0o700)
    os.chmod(path, 0o700)


def _replaceable(final: Path, run_id: str) -> None:
    """A step folder this run may write over: a folder of its own, never a link or another
    run's."""
    if final.is_symlink() or not final.is_dir():
        raise CheckpointError(f"cannot write checkpoint {final}: it exists and is not a folder "
                              "of this run (a symbolic link or a file)")
    if run_of(final) != run_id:
        raise CheckpointError(f"cannot write checkpoint {final}: it is another run's")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(root: Path, keep: int, run_id: str) -> None:
    """Keep the newest `keep` complete checkpoints of run `run_id`; drop its unfinished ones
    of other processes (before a restart or a resume). Other runs' folders are never touched."""
    own = [p for p in complete_checkpoints(root) if run_of(p) == run_id]
    for old in own[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(f".{PREFIX}*.tmp-{run_id}-*"):
        if not stale.name.endswith(f"-{os.getpid()}") and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)



def _value(ctl: Any, ref: Any) -> Any:
    if isinstance(ref, Gather):
        return [_value(ctl, part) for part in ref.parts]
    if isinstance(ref, Item):
        return ctl.fetch(ref.future)[ref.index]
    return ctl.fetch(ref)

