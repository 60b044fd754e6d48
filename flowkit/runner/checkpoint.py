"""Run checkpoints: everything a synchronous flow run needs to go on from a step boundary as if it
had never stopped.

The design: [Note: run checkpoints] below.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import attrs

from flowkit.ops.executor_ops import STATE_OPS
from flowkit.planner.lower import NodePlan
from flowkit.runner.asyncstate import OpenSteps, OpenWork, Resuming, drain, open_work, resume_open
from flowkit.runner.stepstate import RunnerState, Streams
from flowkit.runner.training import model_spec
from flowkit.runtime.futures import wait
from flowkit.runtime.registry import ExecutorInfo
from flowkit.wire.refs import Gather, Item

__all__ = ["CheckpointError", "Manifest", "RunState", "check_resumable", "complete_checkpoints",
           "flow_identity", "latest_checkpoint", "read_manifest", "restore", "write_checkpoint"]


# [Note: run checkpoints] A checkpoint is a folder `step-NNNNNNNN` (N: the steps done) under the
# run's checkpoint root:
#
# manifest.json       the flow's identity, the step, the executors; written last
# run.pkl             the controller's state (`RunState`)
# executors/NAME      each executor's state: the `save_state` op (executors/torch/state.py,
#                     executors/sim.py) writes its held models' weights and optimizer states per
#                     split and stage, their weights versions and its random generators
#
# It is written into a hidden `.step-...tmp` folder that is renamed when every part is in, so a
# checkpoint is complete or absent; the newest `keep` are kept. Executors write their parts
# themselves (no tensor comes to the controller), so the root must be a path they share with it.
#
# What makes a resumed step k draw exactly what step k drew in the uninterrupted run: sources and
# samplers derive their randomness from (seed, step[, prompt, sample]) alone (token_sequences,
# sort_prompts, the rollout engine's counter-based sampler, the simulator), so they need no state
# but the step; executors' torch and Python generators are in their state; the feedback a step reads
# from the previous one (weights versions) is fetched and put back; each trained model's item counts
# (which decide from step 2 on how fused microbatches are cut) and profiled stage costs (which
# decide cost-driven schedules) are in `RunState`. Every op of a step is done at its boundary, so
# nothing is in flight. An asynchronous run's boundary has steps open: its checkpoint also holds
# their generated rollouts and the calls carried past them ([Note: checkpoints of asynchronous runs]
# in asyncstate.py, `RunState.open_work`), and its manifest the staleness bound, which a resumed run
# must keep.

FORMAT = "flowkit.run_checkpoint/1"
MANIFEST = "manifest.json"
RUN_STATE = "run.pkl"
_PREFIX = "step-"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, read or resumed from; the message names why."""


@attrs.frozen(kw_only=True)
class Manifest:
    step: int  # steps done: a resumed run goes on with this step
    identity: dict  # flow_identity's
    executors: list[dict]  # name, tags, kind of each, in name order
    placement: dict = attrs.field(factory=dict)  # model -> the executor of each stage, by name
    written_s: float = 0.0  # seconds the checkpoint took to write
    format: str = FORMAT
    staleness: int | None = None  # an asynchronous run's bound; None: a synchronous run


@attrs.define(kw_only=True)
class RunState:
    """The controller's part of a checkpoint."""

    step: int
    records: list[dict]  # the metrics lines so far, as written
    feedback: dict[tuple, Any]  # (node, port) -> the last value the step before produced
    training: dict[str, dict]  # model -> what its ModelTraining carries across steps
    profiles: dict  # (model, stages) -> profiled stage costs
    # an asynchronous run's open steps [Note: checkpoints of asynchronous runs]; None: sync
    open_work: OpenWork | None = None


def flow_identity(name: str, plan: list[NodePlan]) -> dict:
    """What a checkpoint must match to be resumed by a flow: its name, its nodes, and each
    model's build, config, seed, dtype and stages. JSON-shaped, so it compares after a round
    trip through the manifest."""
    models = {node.model.name: model_spec(node.model, node.model.stages)
              for node in plan if node.model is not None}
    identity = {"flow": name, "nodes": sorted(f"{node.name}:{node.op}" for node in plan),
                "models": models}
    return json.loads(json.dumps(identity, sort_keys=True, default=repr))


class Checkpointed(OpenSteps, Resuming, Protocol):
    """A runner as its checkpoints see it (flowrun.FlowRunner)."""

    ctl: Any  # the controller its executors are reached through
    staleness: int | None  # its bound, None: synchronous

    def state(self) -> RunnerState:
        """What it holds at a step boundary."""

    def resume(self, step: int, feedback: Streams, profiles: dict,
               training: Mapping[str, dict]) -> None:
        """Go on at `step` from what a checkpoint held."""


def executor_layout(executors: list[ExecutorInfo], kind: str) -> list[dict]:
    return [{"name": e.name, "tags": sorted(e.tags), "kind": kind}
            for e in sorted(executors, key=lambda e: e.name)]


# -- writing ----------------------------------------------------------------------------------
def write_checkpoint(root: Path, runner: Checkpointed, *, step: int, identity: dict,
                     executors: list[ExecutorInfo], kind: str, records: list[dict], keep: int,
                     timeout: float = 600.0) -> Path:
    """Write the checkpoint of `runner` after `step` steps (a step boundary: nothing in
    flight) under `root`, and keep the newest `keep`; returns its folder."""
    started = time.perf_counter()
    root = Path(root).resolve()
    final = root / f"{_PREFIX}{step:08d}"
    temp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    (temp / "executors").mkdir(parents=True)
    ctl = runner.ctl
    # first: the open steps' generation ends, and nothing trains until the next step
    if runner.staleness is not None:
        drain(runner, timeout)
    snapshot = runner.state()
    work = None if snapshot.staleness is None else open_work(ctl, snapshot, timeout)
    saves = [ctl.submit("save_state", config={"path": str(temp / "executors" / e.name)},
                        executor=e.id, meta={"node": "checkpoint", "step": step})
             for e in executors if all(op in e.ops for op in STATE_OPS)]
    wait(saves, timeout=timeout)
    for future in saves:
        if future.exception() is not None:
            raise CheckpointError(f"checkpoint of step {step}: {future.exception()}")
    state = RunState(step=step, records=list(records),
                     feedback={key: _value(ctl, ref) for key, ref in snapshot.feedback.items()},
                     training=snapshot.training, profiles=snapshot.profiles, open_work=work)
    _write_synced(temp / RUN_STATE, pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))
    manifest = Manifest(step=step, identity=identity, executors=executor_layout(executors, kind),
                        placement=snapshot.placement,
                        written_s=time.perf_counter() - started, staleness=snapshot.staleness)
    _write_synced(temp / MANIFEST, json.dumps(attrs.asdict(manifest), indent=1).encode())
    if final.exists():  # the same step again (a resumed run interrupted at once): replace it
        shutil.rmtree(final)
    os.rename(temp, final)
    _fsync_dir(root)
    _prune(root, keep)
    return final


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints; drop unfinished ones of other writers."""
    for old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(f".{_PREFIX}*.tmp-*"):
        if not stale.name.endswith(f".tmp-{os.getpid()}"):
            shutil.rmtree(stale, ignore_errors=True)


def _value(ctl: Any, ref: Any) -> Any:
    if isinstance(ref, Gather):
        return [_value(ctl, part) for part in ref.parts]
    if isinstance(ref, Item):
        return ctl.fetch(ref.future)[ref.index]
    return ctl.fetch(ref)


# -- reading and resuming ---------------------------------------------------------------------
def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under `root`, oldest first."""
    found = [p for p in Path(root).glob(f"{_PREFIX}*") if (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(path: Path) -> Path:
    """`path` itself if it is a checkpoint, else the newest complete one under it."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"--resume {path}: no such directory")
    found = complete_checkpoints(path)
    if not found:
        raise CheckpointError(f"--resume {path}: not a run checkpoint (no {MANIFEST} in it, and "
                              f"no complete {_PREFIX}* checkpoint under it)")
    return found[-1]


def read_manifest(folder: Path) -> Manifest:
    try:
        data = json.loads((folder / MANIFEST).read_text())
        if data.get("format") != FORMAT:
            raise CheckpointError(f"--resume {folder}: a checkpoint of format "
                                  f"{data.get('format')!r}; this flowkit reads {FORMAT!r}")
        return Manifest(**data)
    except (OSError, ValueError, TypeError) as exc:
        raise CheckpointError(f"--resume {folder}: unreadable {MANIFEST}: {exc}") from None


def check_resumable(manifest: Manifest, identity: dict, layout: list[dict],
                    folder: Path, staleness: int | None = None) -> None:
    """CheckpointError naming the first mismatch between the checkpoint and this run (of
    staleness bound `staleness`, None: synchronous)."""
    saved = manifest.identity
    where = f"--resume {folder}:"
    if manifest.staleness and manifest.staleness != staleness:  # its open steps' samples
        raise CheckpointError(
            f"{where} a checkpoint of an asynchronous run with --max-staleness "
            f"{manifest.staleness}, whose open steps hold samples generated under that bound; "
            f"this run is {_mode(staleness)}: resume it with --max-staleness "
            f"{manifest.staleness}")
    if saved["flow"] != identity["flow"]:
        raise CheckpointError(f"{where} a checkpoint of flow {saved['flow']!r}, not of "
                              f"{identity['flow']!r}")
    for name in sorted(set(saved["models"]) | set(identity["models"])):
        mine, theirs = identity["models"].get(name), saved["models"].get(name)
        if mine is None or theirs is None:
            raise CheckpointError(f"{where} model {name!r} is only in "
                                  f"{'the checkpoint' if mine is None else 'this flow'}")
        problem = _spec_difference(theirs, mine)
        if problem:
            raise CheckpointError(f"{where} model {name!r} differs: {problem}")
    if saved["nodes"] != identity["nodes"]:
        gone = sorted(set(saved["nodes"]) - set(identity["nodes"]))
        new = sorted(set(identity["nodes"]) - set(saved["nodes"]))
        raise CheckpointError(f"{where} the flow's ops differ: only in the checkpoint "
                              f"{gone or '-'}, only in this run {new or '-'}")
    if manifest.executors != layout:
        raise CheckpointError(f"{where} written by executors {_layout_text(manifest.executors)}; "
                              f"this run starts {_layout_text(layout)}: give the same "
                              "--executors, --num-executors and --tags")


def _mode(staleness: int | None) -> str:
    return "synchronous" if staleness is None else f"run with --max-staleness {staleness}"


def _spec_difference(saved: dict, mine: dict) -> str:
    config_saved, config_mine = saved.get("model_config", {}), mine.get("model_config", {})
    for key in sorted(set(config_saved) | set(config_mine)):
        if config_saved.get(key) != config_mine.get(key):
            return (f"{key}={config_saved.get(key)!r} in the checkpoint, "
                    f"{config_mine.get(key)!r} in this run")
    for key in sorted(set(saved) | set(mine)):
        if key != "model_config" and saved.get(key) != mine.get(key):
            return f"{key}={saved.get(key)!r} in the checkpoint, {mine.get(key)!r} in this run"
    return ""


def _layout_text(layout: list[dict]) -> str:
    kinds = sorted({e["kind"] for e in layout})
    tags = "; ".join(f"{e['name']}: {','.join(e['tags']) or '-'}" for e in layout)
    return f"{len(layout)} {'/'.join(kinds)} ({tags})"


def restore(folder: Path, runner: Checkpointed, executors: list[ExecutorInfo], *,
            timeout: float = 600.0) -> RunState:
    """Put the checkpoint in `folder` back: every executor loads its state, the runner its
    feedback and what its trainings carry; returns the controller's state (its step: the next
    one to run)."""
    ctl = runner.ctl
    saved, placement = read_manifest(folder).placement, runner.state().placement
    if saved != placement:  # each executor's state is of the stages it held
        raise CheckpointError(f"--resume {folder}: the checkpointed run placed the models' stages "
                              f"on {saved}, this run on {placement}")
    loads = []
    for e in executors:
        part = folder / "executors" / e.name
        if part.exists():
            loads.append(ctl.submit("load_state", config={"path": str(part.resolve())},
                                    executor=e.id, meta={"node": "resume"}))
    wait(loads, timeout=timeout)
    for future in loads:
        if future.exception() is not None:
            raise CheckpointError(f"--resume {folder}: {future.exception()}")
    try:
        state: RunState = pickle.loads((folder / RUN_STATE).read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError) as exc:
        raise CheckpointError(f"--resume {folder}: unreadable {RUN_STATE}: {exc}") from None
    previous = Streams()
    for key, value in state.feedback.items():
        previous[key].add((0,), ctl.put(value))
        previous[key].closed = True
    runner.resume(state.step, previous, state.profiles, state.training)
    work = getattr(state, "open_work", None)  # absent from a checkpoint of an older flowkit
    if work is not None:
        resume_open(runner, ctl, work)
    return state
