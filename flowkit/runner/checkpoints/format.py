"""Run checkpoints: everything a synchronous flow run needs to go on from a step boundary as if it
had never stopped. This module holds their format (a folder of a manifest, the controller's state
and each executor's) and reading it back; writer.py writes one, restore.py resumes from one.

The design: [Note: run checkpoints] below.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import attrs

from flowkit.planner.lower import NodePlan
from flowkit.runner.checkpoints.controller_state import MAX_RUN_STATE, RunState, read_state
from flowkit.runner.checkpoints.open_steps import OpenSteps, Resuming
from flowkit.runner.checkpoints.state_codec import CheckpointError, read_private
from flowkit.runner.stepstate import RunnerState, Streams
from flowkit.runner.training_tasks import model_spec
from flowkit.runtime.registry import ExecutorInfo
from flowkit.wire.files import FileRefused, is_plain_name, open_regular, sha256_of

__all__ = ["FORMAT", "MANIFEST", "PICKLED_STATE", "PREFIX", "RUN_STATE", "CheckpointError",
           "Checkpointed",
           "Manifest", "RunState", "check_root", "complete_checkpoints", "executor_layout",
           "executor_states",
           "flow_identity", "flow_models", "latest_checkpoint", "new_run_id", "read_manifest",
           "read_run_state", "run_of", "run_record", "verify_files"]


# [Note: run checkpoints] A checkpoint is a folder `step-NNNNNNNN` (N: the steps done) under the
# run's checkpoint root: manifest.json (the flow's and the run's identity, the step, the
# executors; written last), run.msgpack (the controller's `RunState`: plain values checked against
# a schema, never pickle [Note: run state on disk in flowkit/runner/checkpoints/state_codec.py])
# and executors/NAME (each executor's `save_state`: a safetensors file of its trained weights and
# optimizer states by the unsplit model's names, versions, random generators [Note: layout-free
# checkpoints in executors/torch/layout_free.py]). It is written into a hidden
# `.step-...tmp` folder renamed when every part is in, so it is complete or absent; files 0600,
# folders 0700; a run's id keeps a fresh run off another run's root (check_root). Executors write
# their parts themselves, so the root must be a path they share with the controller. Why a
# resumed step k draws what step k drew: sources and samplers derive their randomness from
# (seed, step[, prompt, sample]) alone; generators, feedback versions, item counts and profiled
# costs are saved. An asynchronous run's checkpoint also holds its open steps' rollouts ([Note:
# checkpoints of asynchronous runs] in open_steps.py) and its staleness bound. In full:
# docs/running-flows.md, "Checkpoints and resume".

FORMAT = "flowkit.run_checkpoint/2"
MANIFEST = "manifest.json"
RUN_STATE = "run.msgpack"
PICKLED_STATE = "run.pkl"  # an older flowkit's run state: refused, never unpickled
PREFIX = "step-"
_MAX_MANIFEST = 1 << 24  # bytes
_TORCH_SAVE = b"PK\x03\x04"  # how a torch.save file (an older executor state) begins
MAX_EXECUTOR_STATE = 1 << 40  # bytes: past any model flowkit runs (executors/torch/state_file.py)


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
    # the SHA-256 of each file by its path in the folder [Note: checkpoint checksums]; None in
    # a checkpoint written before them
    files: dict[str, str] | None = None


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
    from (executors/torch/state.py), never a checkpoint file's. A backprop's reference is one
    (its last stage holds it [Note: reference in the F in executors/torch/train/rows.py])."""
    models = [model for node in plan for model in (node.model, node.reference)
              if model is not None]
    return {model.name: model_spec(model, model.stages) for model in models}


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


def run_of(folder: Path) -> str | None:
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
    steps = sorted(p for p in root.glob(f"{PREFIX}*"))
    others = [p for p in steps if run_of(p) != run_id]
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



# -- reading ------------------------------------------------------------------------------
def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under `root`, oldest first (symbolic links among them too:
    reading one refuses it, naming it)."""
    found = [p for p in Path(root).glob(f"{PREFIX}*") if os.path.lexists(p / MANIFEST)]
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
                              f"no complete {PREFIX}* checkpoint under it): {_resumable(path)}")
    return found[-1]


def _resumable(path: Path) -> str:
    """Where run checkpoints come from, and how weights (a --save-weights folder's) are used."""
    weights = sorted(p.name for p in path.glob("*.pt"))
    held = f" (this folder's {weights[0]})" if weights else ""
    example = str(path / weights[0]) if weights else "DIR/MODEL.pt"
    return (f"run checkpoints come from --checkpoint-dir (with --checkpoint-every); weights "
            f"that --save-weights wrote{held} start a run when the model's config names the "
            f"file: checkpoint={example!r}")


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
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _manifest_problem(fields: dict) -> str:
    """What is wrong with a manifest's fields, or ""."""
    if set(fields) - {"files"} != _MANIFEST_FIELDS:
        return (f"fields {sorted(map(str, fields))[:10]}, expected "
                f"{sorted(_MANIFEST_FIELDS | {'files'})}")
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
        (fields.get("files") is None or isinstance(fields["files"], dict) and all(
            _in_folder(k) and isinstance(v, str) and _SHA256.fullmatch(v)
            for k, v in fields["files"].items()),
         "files is not a map of the folder's files to their SHA-256"),
    ]
    problem = next((problem for ok, problem in checks if not ok), "")
    if problem:
        return problem
    names = [e["name"] for e in fields["executors"]] + [
        name for names in fields["placement"].values() for name in names]
    escaping = next((name for name in names if not is_plain_name(name)), None)
    if escaping is not None:  # a path out of executors/ [Note: contained files]
        return f"executor name {escaping[:80]!r} is not a plain name (a file of executors/)"
    return ""


def _in_folder(name: Any) -> bool:
    """A name of a checkpoint's own file: run.msgpack, or executors/NAME."""
    if name == RUN_STATE:
        return True
    folder, _, part = str(name).partition("/")
    return folder == "executors" and is_plain_name(part)


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


def read_run_state(folder: Path, records: Mapping[str, type], sha256: str | None = None
                   ) -> RunState:
    """The controller's state in checkpoint `folder` (of that SHA-256, when given), its record
    classes looked up in `records` (state_codec.allowed_records): data only, checked field by
    field."""
    return read_state(Path(folder) / RUN_STATE, records, sha256)


def executor_states(folder: Path) -> Path:
    """The folder of checkpoint `folder`'s executor states, a folder of its own: a symbolic
    link in its place would make the executors read files elsewhere [Note: contained files in
    flowkit/wire/files.py]."""
    states = Path(folder) / "executors"
    try:
        info = os.lstat(states)
    except FileNotFoundError:
        return states  # none saved (a run without executor states)
    if stat.S_ISLNK(info.st_mode):
        raise CheckpointError(f"--resume {folder}: {states} is a symbolic link; a "
                              "checkpoint's files must be its own")
    if not stat.S_ISDIR(info.st_mode):
        raise CheckpointError(f"--resume {folder}: {states} is not a folder")
    return states




def verify_files(folder: Path, manifest: Manifest) -> None:
    """Every file the manifest lists is there, a regular file of its SHA-256 [Note: checkpoint
    checksums in writer.py]: checked before any executor starts, so a checkpoint missing a file
    or holding a changed one is one line naming it, not a failure half-way through a resume.
    A checkpoint written before checksums has nothing to check here (restore.py warns)."""
    executor_states(folder)  # not a link to files elsewhere
    for name, digest in sorted((manifest.files or {}).items()):
        path = Path(folder) / name
        if not os.path.lexists(path):
            raise CheckpointError(f"--resume {folder}: {name} is missing, and {MANIFEST} lists "
                                  "it: the checkpoint is incomplete; resume from another one")
        limit = MAX_RUN_STATE if name == RUN_STATE else MAX_EXECUTOR_STATE
        try:
            fd, size = open_regular(path, limit=limit)
        except FileRefused as exc:
            raise CheckpointError(f"--resume {folder}: {exc}") from None
        try:
            found, start = sha256_of(fd, size), os.pread(fd, 4, 0)
        finally:
            os.close(fd)
        if name != RUN_STATE and start == _TORCH_SAVE:
            raise CheckpointError(f"--resume {folder}: {name} is a torch.save file, an executor "
                                  "state of an older flowkit; this one reads safetensors "
                                  "states: resume it with the flowkit that wrote it")
        if found != digest:
            raise CheckpointError(f"--resume {folder}: {path} does not match its SHA-256 in "
                                  f"{MANIFEST}: it changed after it was written; resume from "
                                  "another checkpoint")
