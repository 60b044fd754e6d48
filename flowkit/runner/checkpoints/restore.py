"""Resuming from a run checkpoint ([Note: run checkpoints in
flowkit/runner/checkpoints/format.py]): whether this run may, and putting the executors' and the
runner's state back.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from flowkit.runner.checkpoints.controller_state import RunState
from flowkit.runner.checkpoints.format import (
    MANIFEST,
    RUN_STATE,
    Checkpointed,
    Manifest,
    executor_states,
    read_manifest,
    read_run_state,
)
from flowkit.runner.checkpoints.open_steps import resume_open
from flowkit.runner.checkpoints.state_codec import CheckpointError
from flowkit.runner.replicas import state_sources
from flowkit.runner.stepstate import Streams
from flowkit.runtime.futures import wait
from flowkit.runtime.registry import ExecutorInfo

__all__ = ["check_resumable", "restore"]

log = logging.getLogger("flowkit.runner")


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


def _checksums(folder: Path, manifest: Manifest) -> dict[str, str] | None:
    """[Note: checkpoint checksums] in writer.py: each file's SHA-256 by its absolute path, or
    None for a checkpoint written before them (loaded, with a warning)."""
    if manifest.files is None:
        log.warning("--resume %s: written before checkpoints carried checksums: its files are "
                    "loaded unverified", folder)
        return None
    return {str((Path(folder) / name).absolute()): digest
            for name, digest in manifest.files.items()}


def _checksum(checksums: dict[str, str] | None, path: Path) -> str | None:
    if checksums is None:
        return None
    digest = checksums.get(str(path.absolute()))
    if digest is None:
        raise CheckpointError(f"--resume: {path} has no SHA-256 in {MANIFEST}")
    return digest


def _mode(staleness: int | None) -> str:
    return "synchronous" if staleness is None else f"run with --max-staleness {staleness}"


def _spec_difference(saved: dict, mine: dict) -> str:
    config_saved, config_mine = saved.get("model_config", {}), mine.get("model_config", {})
    for key in sorted(set(config_saved) | set(config_mine)):
        if config_saved.get(key) != config_mine.get(key):
            return (f"{key}={config_saved.get(key)!r} in the checkpoint, "
                    f"{config_mine.get(key)!r} in this run")
    for key in sorted(set(saved) | set(mine)):
        # another --stages is not a difference [Note: layout-free checkpoints]
        if key not in ("model_config", "stages") and saved.get(key) != mine.get(key):
            return f"{key}={saved.get(key)!r} in the checkpoint, {mine.get(key)!r} in this run"
    return ""


def _same_executors(manifest: Manifest, layout: list[dict], identity: dict,
                    replicas: Mapping[str, int]) -> bool:
    """The executors both runs have are alike, and the counts differ by what other replica
    counts and stages make, or not at all."""
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
    # the same executors in another layout (other --stages of a model beside the executors
    # that generate) keep every executor's own state [Note: layout-free checkpoints]
    return len(now) - len(saved) in (extra, 0)


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
    ctl, manifest = runner.ctl, read_manifest(folder)
    states = executor_states(folder)
    checksums = _checksums(folder, manifest)
    state = read_run_state(folder, records, _checksum(checksums, Path(folder) / RUN_STATE))
    saved, placement = manifest.placement, runner.boundary().placement
    trainings = getattr(runner, "training", {})
    sources = state_sources(saved, placement, {name: t.devices for name, t in trainings.items()})
    files = [str((states / e["name"]).absolute()) for e in manifest.executors
             if os.path.lexists(states / e["name"])]
    loads = []
    for e in executors:
        part = states / sources.get(e.name, e.name)
        if part.is_symlink():
            raise CheckpointError(f"--resume {folder}: {part} is a symbolic link; a "
                                  "checkpoint's files must be its own")
        own = str(part.absolute()) if os.path.lexists(part) else None
        # [Note: layout-free checkpoints in executors/torch/layout_free.py]
        trains = sorted(m for m in trainings if e.name in placement.get(m, ()))
        if own is not None or trains:
            config = {"path": own, "files": files if trains else [], "models": dict(models),
                      "trains": trains, "checksums": checksums}
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
