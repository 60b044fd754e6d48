"""Run checkpoints: everything a synchronous flow run needs to go on from a step boundary as if it
had never stopped.

The design: [Note: run checkpoints] below.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import secrets
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import attrs

from flowkit.ops.executor_ops import STATE_OPS
from flowkit.planner.lower import NodePlan
from flowkit.runner.asyncstate import OpenSteps, Resuming, open_work, resume_open
from flowkit.runner.replicas import optimizer_shards, state_sources
from flowkit.runner.runstate import (
    CheckpointError,
    RunState,
    read_private,
    read_state,
    state_bytes,
    write_private,
)
from flowkit.runner.stepstate import RunnerState, Streams
from flowkit.runner.training import model_spec
from flowkit.runtime.futures import wait
from flowkit.runtime.registry import ExecutorInfo
from flowkit.wire.refs import Gather, Item

__all__ = ["CheckpointError", "Manifest", "RunState", "check_resumable", "check_root",
           "complete_checkpoints", "flow_identity", "flow_models", "latest_checkpoint",
           "new_run_id",
           "read_manifest", "read_run_state", "restore", "write_checkpoint"]


# [Note: run checkpoints] A checkpoint is a folder `step-NNNNNNNN` (N: the steps done) under the
# run's checkpoint root:
#
# manifest.json       the flow's identity, the run's (`run`: its id, flow and the flow's hash),
#                     the step, the executors; written last
# run.msgpack         the controller's state (`RunState`): plain values checked against a schema
#                     when read, never pickle [Note: run state on disk in runstate.py]
# executors/NAME      each executor's state: the `save_state` op (executors/torch/state.py,
#                     executors/sim.py) writes its held models' weights and optimizer states per
#                     split and stage, their weights versions and its random generators (tensors
#                     and plain values, read back with torch.load(weights_only=True); the models
#                     are built again from the flow's build and config, never the file's)
#
# It is written into a hidden `.step-...tmp` folder that is renamed when every part is in, so a
# checkpoint is complete or absent; the newest `keep` of this run are kept. Files are 0600 and
# folders 0700 whatever the umask. A run has an id, made when it starts and kept by a resumed
# run: a fresh run refuses a root that holds another run's checkpoints (check_root), and pruning
# touches only its own. Executors write their parts themselves (no tensor comes to the
# controller), so the root must be a path they share with it.
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

FORMAT = "flowkit.run_checkpoint/2"
MANIFEST = "manifest.json"
RUN_STATE = "run.msgpack"
PICKLED_STATE = "run.pkl"  # an older flowkit's run state: refused, never unpickled
_PREFIX = "step-"
_MAX_MANIFEST = 1 << 24  # bytes


@attrs.frozen(kw_only=True)
class Manifest:
    step: int  # steps done: a resumed run goes on with this step
    identity: dict  # flow_identity's
    executors: list[dict]  # name, tags, kind of each, in name order
    run: dict  # the run that wrote it: id, flow, flow_hash
    placement: dict = attrs.field(factory=dict)  # model -> the executor of each stage, by name
    written_s: float = 0.0  # seconds the checkpoint took to write
    format: str = FORMAT
    staleness: int | None = None  # an asynchronous run's bound; None: a synchronous run


def new_run_id() -> str:
    """A fresh run's id: random, so two runs never share one."""
    return secrets.token_hex(8)


def flow_identity(name: str, plan: list[NodePlan]) -> dict:
    """What a checkpoint must match to be resumed by a flow: its name, its nodes, and each
    model's build, config, seed, dtype and stages. JSON-shaped, so it compares after a round
    trip through the manifest."""
    identity = {"flow": name, "nodes": sorted(f"{node.name}:{node.op}" for node in plan),
                "models": flow_models(plan)}
    return json.loads(json.dumps(identity, sort_keys=True, default=repr))


def flow_models(plan: list[NodePlan]) -> dict[str, dict]:
    """Each model's spec as the flow declares it: what a resumed executor builds its models
    from (executors/torch/state.py), never a checkpoint file's."""
    return {node.model.name: model_spec(node.model, node.model.stages)
            for node in plan if node.model is not None}


def run_record(run_id: str, identity: dict) -> dict:
    """What a checkpoint says of the run that wrote it."""
    text = json.dumps(identity, sort_keys=True)
    return {"id": run_id, "flow": identity["flow"],
            "flow_hash": hashlib.sha256(text.encode()).hexdigest()[:16]}


class Checkpointed(OpenSteps, Resuming, Protocol):
    """A runner as its checkpoints see it (flowrun.FlowRunner)."""

    ctl: Any  # the controller its executors are reached through
    staleness: int | None  # its bound, None: synchronous
    events: Any  # its reactions' queue
    open: dict  # step -> its open steps' runs
    carried: dict  # the ledger's carried calls for steps not open
    generating: list[str]  # the nodes whose calls an asynchronous checkpoint holds

    def boundary(self) -> RunnerState:
        """What it holds at a step boundary but the open steps' generation."""

    def open_state(self, runs: Mapping[int, Any],
                   carried: Mapping[int, dict[str, list]]) -> dict[str, Any]:
        """The open steps' part, once their generating nodes have ended."""

    def resume(self, step: int, feedback: Streams, profiles: dict,
               training: Mapping[str, dict]) -> None:
        """Go on at `step` from what a checkpoint held."""


def executor_layout(executors: list[ExecutorInfo], kind: str) -> list[dict]:
    return [{"name": e.name, "tags": sorted(e.tags), "kind": kind}
            for e in sorted(executors, key=lambda e: e.name)]


# -- writing ----------------------------------------------------------------------------------
# [Note: checkpoints that do not drain] An asynchronous run's checkpoint at a step boundary holds
# what its open steps generate ([Note: checkpoints of asynchronous runs] in asyncstate.py), which
# is done only once their generating nodes have ended. Waiting for that at the boundary stopped
# training for the η open steps' generation (29 % of the throughput with a checkpoint every
# step). Instead a checkpoint is begun at the boundary and finished when that generation has
# ended, while the run goes on (`begin_checkpoint`, `PendingCheckpoint`):
#   - at the boundary (nothing trains): the executors are told to save their states, ahead of any
#     task of the next step, so what they write is the boundary's; the runner's part but the open
#     steps (placement, feedback refs, training counters, profiles) is copied, and so are the
#     open steps' runs and the ledger's calls for steps not open yet (`FlowRunner.boundary`);
#   - the run goes on: the open steps generate as they would have, the next step trains. After
#     each burst of reactions the runner asks the checkpoint whether the states are written and
#     the boundary's open steps' generating nodes have ended; then it fetches their outputs, metrics
#     and carried calls (`FlowRunner.open_state`), writes the run state and the manifest and renames
#     the folder in, as a drained checkpoint would have held them: the open steps' samples are
#     the same whether the next step trained meanwhile or not (a sample keeps the versions its
#     tokens had), and nothing of the steps opened after the boundary is in it;
#   - checkpoints finish in the order they began; the run's end, a Ctrl-C and a synchronous run
#     wait for theirs at once. A run that fails before a checkpoint finishes loses only that one:
#     its folder was never renamed in, and a restart goes back to the newest finished one.
# A synchronous run's boundary has no open steps: its checkpoint finishes as soon as it begins.
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
    final = root / f"{_PREFIX}{step:08d}"
    temp = root / f".{final.name}.tmp-{run_id}-{os.getpid()}"
    _private_dir(root, parents=True)
    shutil.rmtree(temp, ignore_errors=True)
    _private_dir(temp)
    _private_dir(temp / "executors")
    ctl = runner.ctl
    saves = [ctl.submit("save_state", config={"path": str(temp / "executors" / e.name)},
                        executor=e.id, meta={"node": "checkpoint", "step": step})
             for e in executors if all(op in e.ops for op in STATE_OPS)]
    for future in saves:  # the runner looks at the checkpoint again once it is saved
        future.add_done_callback(lambda _: runner.events.put(_nothing))
    return PendingCheckpoint(
        root=root, final=final, temp=temp, step=step, identity=identity,
        layout=executor_layout(executors, kind), records=list(records), keep=keep,
        run_id=run_id, timeout=timeout, saves=saves, boundary=runner.boundary(),
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
                runner.react(max(0.0, deadline - time.monotonic()))
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
        write_private(temp / RUN_STATE, state_bytes(state))
        manifest = Manifest(step=self.step, identity=self.identity, executors=self.layout,
                            run=run_record(self.run_id, self.identity),
                            placement=snapshot.placement,
                            written_s=time.perf_counter() - self.started,
                            staleness=snapshot.staleness)
        write_private(temp / MANIFEST, json.dumps(attrs.asdict(manifest), indent=1).encode())
        if os.path.lexists(final):  # the same step again (a resumed run interrupted at once)
            _replaceable(final, self.run_id)
            shutil.rmtree(final)
        os.rename(temp, final)
        _fsync_dir(self.root)
        _prune(self.root, self.keep, self.run_id)
        return final

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
    if _run_of(final) != run_id:
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
    own = [p for p in complete_checkpoints(root) if _run_of(p) == run_id]
    for old in own[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(f".{_PREFIX}*.tmp-{run_id}-*"):
        if not stale.name.endswith(f"-{os.getpid()}") and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)


def _run_of(folder: Path) -> str | None:
    """The id of the run that wrote checkpoint `folder`; None when its manifest cannot say."""
    try:
        return read_manifest(folder).run["id"]
    except CheckpointError:
        return None


def check_root(root: Path, run_id: str) -> None:
    """A CheckpointError of one line when checkpoint root `root` holds checkpoints of another
    run than `run_id` (a fresh run's new id, or the id of the run a resumed one goes on)."""
    root = Path(root)
    if not root.is_dir():
        return
    steps = sorted(p for p in root.glob(f"{_PREFIX}*"))
    others = [p for p in steps if _run_of(p) != run_id]
    if others:
        first = others[0]
        try:
            manifest = read_manifest(first)
            whose = f"run {manifest.run['id']} of flow {manifest.run['flow']!r}"
        except CheckpointError as exc:
            whose = f"a run this flowkit cannot read ({str(exc).split(': ', 2)[-1]})"
        names = ", ".join(p.name for p in others[:3]) + (", ..." if len(others) > 3 else "")
        raise CheckpointError(f"--checkpoint-dir {root} holds checkpoints of another run "
                              f"({names}: {whose}): go on with it with --resume {root}, or give "
                              "another --checkpoint-dir")


def _value(ctl: Any, ref: Any) -> Any:
    if isinstance(ref, Gather):
        return [_value(ctl, part) for part in ref.parts]
    if isinstance(ref, Item):
        return ctl.fetch(ref.future)[ref.index]
    return ctl.fetch(ref)


# -- reading and resuming ---------------------------------------------------------------------
def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under `root`, oldest first (symbolic links among them too:
    reading one refuses it, naming it)."""
    found = [p for p in Path(root).glob(f"{_PREFIX}*") if os.path.lexists(p / MANIFEST)]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(path: Path) -> Path:
    """`path` itself if it is a checkpoint, else the newest complete one under it."""
    path = Path(path)
    if os.path.lexists(path / MANIFEST):
        return path
    if not path.is_dir():
        raise CheckpointError(f"--resume {path}: no such directory")
    found = complete_checkpoints(path)
    if not found:
        raise CheckpointError(f"--resume {path}: not a run checkpoint (no {MANIFEST} in it, and "
                              f"no complete {_PREFIX}* checkpoint under it)")
    return found[-1]


def read_manifest(folder: Path) -> Manifest:
    """The manifest of checkpoint `folder`, every field checked: a CheckpointError of one line
    naming the file otherwise."""
    folder = Path(folder)
    if folder.is_symlink():
        raise CheckpointError(f"--resume {folder}: the checkpoint folder is a symbolic link; "
                              "give the folder itself")
    path = folder / MANIFEST
    data = read_private(path, f"--resume {folder}", _MAX_MANIFEST)
    try:
        fields = json.loads(data)
    except ValueError as exc:
        raise CheckpointError(f"--resume {folder}: unreadable {MANIFEST}: {exc}") from None
    if not isinstance(fields, dict) or fields.get("format") != FORMAT:
        found = fields.get("format") if isinstance(fields, dict) else None
        older = (f" (its {PICKLED_STATE} is a pickle, which this flowkit never loads: it "
                 "could run code)" if os.path.lexists(folder / PICKLED_STATE) else "")
        raise CheckpointError(f"--resume {folder}: a checkpoint of format {found!r}; this "
                              f"flowkit reads {FORMAT!r}{older}")
    problem = _manifest_problem(fields)
    if problem:
        raise CheckpointError(f"--resume {path}: {problem}; the file is damaged or was not "
                              "written by flowkit")
    return Manifest(**fields)


_MANIFEST_FIELDS = {"step", "identity", "executors", "run", "placement", "written_s", "format",
                    "staleness"}


def _manifest_problem(fields: dict) -> str:
    """What is wrong with a manifest's fields, or ""."""
    if set(fields) != _MANIFEST_FIELDS:
        return (f"fields {sorted(map(str, fields))[:10]}, expected "
                f"{sorted(_MANIFEST_FIELDS)}")
    checks = [
        (_whole(fields["step"]), "step is not a whole number >= 0"),
        (fields["staleness"] is None or _whole(fields["staleness"]),
         "staleness is not a whole number or null"),
        (isinstance(fields["written_s"], (int, float)), "written_s is not a number"),
        (_is_run(fields["run"]), "run is not {id, flow, flow_hash} of strings"),
        (_is_identity(fields["identity"]), "identity is not {flow, nodes, models}"),
        (isinstance(fields["executors"], list) and all(
            isinstance(e, dict) and set(e) == {"name", "tags", "kind"}
            and isinstance(e["name"], str) and isinstance(e["kind"], str) and _strings(e["tags"])
            for e in fields["executors"]), "executors is not a list of {name, tags, kind}"),
        (isinstance(fields["placement"], dict) and all(
            isinstance(k, str) and _strings(v) for k, v in fields["placement"].items()),
         "placement is not a map of model to executor names"),
    ]
    return next((problem for ok, problem in checks if not ok), "")


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _is_run(value: Any) -> bool:
    return (isinstance(value, dict) and set(value) == {"id", "flow", "flow_hash"}
            and all(isinstance(v, str) for v in value.values()))


def _is_identity(value: Any) -> bool:
    return (isinstance(value, dict) and set(value) == {"flow", "nodes", "models"}
            and isinstance(value["flow"], str) and _strings(value["nodes"])
            and isinstance(value["models"], dict)
            and all(isinstance(k, str) and isinstance(v, dict)
                    and isinstance(v.get("model_config", {}), dict)
                    for k, v in value["models"].items()))


def read_run_state(folder: Path, records: Mapping[str, type]) -> RunState:
    """The controller's state in checkpoint `folder`, its record classes looked up in
    `records` (runstate.allowed_records): data only, checked field by field."""
    return read_state(Path(folder) / RUN_STATE, records)


def check_resumable(manifest: Manifest, identity: dict, layout: list[dict],
                    folder: Path, staleness: int | None = None,
                    replicas: Mapping[str, int] | None = None) -> None:
    """CheckpointError naming the first mismatch between the checkpoint and this run (of
    staleness bound `staleness`, None: synchronous; training its models with `replicas`, by
    name: other counts than the checkpoint's change how many executors it needs [Note:
    resuming at another replica count])."""
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
    if not _same_executors(manifest, layout, identity, replicas or {}):
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


def _same_executors(manifest: Manifest, layout: list[dict], identity: dict,
                    replicas: Mapping[str, int]) -> bool:
    """The executors both runs have are alike, and the counts differ by what other replica
    counts make (restore() then checks which executor loads which state)."""
    saved = {e["name"]: e for e in manifest.executors}
    now = {e["name"]: e for e in layout}
    if any(saved[name] != now[name] for name in saved.keys() & now.keys()):
        return False
    extra = 0
    for model, count in replicas.items():
        stages = int(identity["models"].get(model, {}).get("stages", 1))
        held = len(manifest.placement.get(model, ()))
        if held:
            extra += stages * count - held
    return len(now) - len(saved) == extra


def _layout_text(layout: list[dict]) -> str:
    kinds = sorted({e["kind"] for e in layout})
    tags = "; ".join(f"{e['name']}: {','.join(e['tags']) or '-'}" for e in layout)
    return f"{len(layout)} {'/'.join(kinds)} ({tags})"


def restore(folder: Path, runner: Checkpointed, executors: list[ExecutorInfo], *,
            records: Mapping[str, type], models: Mapping[str, dict],
            timeout: float = 600.0) -> RunState:
    """Put the checkpoint in `folder` back: every executor loads its state (its models built
    from `models`, the flow's specs by name, never from what the file says), the runner its
    feedback and what its trainings carry; returns the controller's state (its step: the next
    one to run). The run state is read and checked first: a damaged one changes nothing."""
    ctl = runner.ctl
    state = read_run_state(folder, records)
    saved, placement = read_manifest(folder).placement, runner.boundary().placement
    trainings = getattr(runner, "training", {})
    try:  # [Note: resuming at another replica count] in replicas.py
        sources = state_sources(saved, placement,
                                {name: t.devices for name, t in trainings.items()})
    except ValueError as exc:
        raise CheckpointError(f"--resume {folder}: {exc}") from None
    shards = optimizer_shards(folder, saved, placement, trainings)
    loads = []
    for e in executors:
        part = Path(folder) / "executors" / sources.get(e.name, e.name)
        if part.is_symlink():
            raise CheckpointError(f"--resume {folder}: {part} is a symbolic link; a "
                                  "checkpoint's files must be its own")
        if part.exists():
            config = {"path": str(part.absolute()), "models": dict(models),
                      "optimizer_shards": shards.get(e.name, {})}
            loads.append(ctl.submit("load_state", config=config, executor=e.id,
                                    meta={"node": "resume"}))
    wait(loads, timeout=timeout)
    for future in loads:
        if future.exception() is not None:
            raise CheckpointError(f"--resume {folder}: {future.exception()}")
    previous = Streams()
    for key, value in state.feedback.items():
        previous[key].add((0,), ctl.put(value))
        previous[key].closed = True
    runner.resume(state.step, previous, state.profiles, state.training)
    if state.open_work is not None:
        resume_open(runner, ctl, state.open_work)
    return state
