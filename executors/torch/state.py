"""An executor's part of a run checkpoint [Note: run checkpoints in flowkit/runner/checkpoint.py]:
`save_state` writes every model this executor holds that training or a weight sync changed
(per split and stage: the parameters and buffers, the optimizer state, the weights version)
and its random number generators; `load_state` builds the same models again and puts it all back.

A model no op changed since it was built (a frozen reference) is written by name only: it is
built again from its build path and seed, which gives the same weights [Note: one model, many
holders in held.py]. Building seeds torch's generator, so `load_state` builds every model first
and restores the generators last: the next op draws what the uninterrupted run's would.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch

from executors.optable import OpContext
from executors.torch.held import held_model, held_stage
from executors.torch.stage import StageError

__all__ = ["load_state", "save_state", "state_of"]

_FORMAT = "flowkit.executor_state/1"


def state_of(ctx: OpContext) -> dict[str, Any]:
    """What this executor holds that a run must get back, as one picklable dict of tensors."""
    models = []
    for (name, stages), held in sorted(ctx.state.get("torch_models", {}).items()):
        changed = held.version is not None or any(
            s.optimizer is not None for s in held.stages.values())
        parts = {}
        if changed:  # every stage of a loaded copy; only the trained ones of a training split
            indices = range(len(held.parts)) if held.version is not None else sorted(held.stages)
            parts = {i: held.parts[i].state_dict() for i in indices}
        optimizers = {i: s.optimizer.state_dict() for i, s in held.stages.items()
                      if s.optimizer is not None}
        models.append({"name": name, "stages": stages, "config": held.config, "parts": parts,
                       "optimizers": optimizers, "version": held.version,
                       "held_stages": sorted(held.stages)})
    return {"format": _FORMAT, "models": models, "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate()}


def save_state(ctx: OpContext, *_: Any, path: str) -> int:
    """Write this executor's state to `path` (inside the checkpoint's unfinished folder, which
    the controller renames when every part is in); returns the bytes written."""
    with open(path, "wb") as file:
        torch.save(state_of(ctx), file)
        file.flush()
        os.fsync(file.fileno())  # on disk before the controller renames the checkpoint in
    return Path(path).stat().st_size


def load_state(ctx: OpContext, *_: Any, path: str) -> int:
    """Build the models `path` names and load their weights, optimizer states and versions,
    then this executor's random generators; returns how many models it holds."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as exc:
        raise StageError(f"cannot read executor state {path}: {exc}") from exc
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise StageError(f"{path} is not an executor state of this flowkit ({_FORMAT})")
    _forget_models(ctx)
    for entry in state["models"]:
        _restore(ctx, entry, path)
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    return len(state["models"])


def _forget_models(ctx: OpContext) -> None:
    """Drop every model this executor holds, and the rollout engines that decode with them,
    before a load: a step that failed part-way ([Note: executor restarts] in
    flowkit/runner/restarts.py) may have changed any of them, also one the checkpoint holds by
    name only, so each is built again from its seed. The engines have nothing in flight
    (the controller waits for that), and the next generate request makes a new one."""
    for held in ctx.state.pop("torch_models", {}).values():
        for stage in held.stages.values():
            stage.runner.reset()
    for name in [n for n in ctx.background if n.startswith("generate:")]:
        del ctx.background[name]


def _restore(ctx: OpContext, entry: dict, path: str) -> None:
    held = held_model(ctx, {**entry["config"], "model": entry["name"],
                            "stages": entry["stages"]})
    what = f"model {entry['name']!r} in {entry['stages']} stage(s) (from {path})"
    for index, tensors in entry["parts"].items():
        try:
            held.parts[index].load_state_dict(tensors)
        except RuntimeError as exc:  # shapes or names: one line, the first mismatch
            first = str(exc).strip().splitlines()
            raise StageError(f"{what}, stage {index}: {first[1 if len(first) > 1 else 0]}"
                             .strip()) from None
    for index in entry["held_stages"]:
        held_stage(ctx, {**entry["config"], "model": entry["name"], "stages": entry["stages"],
                         "stage": index})
    for index, saved in entry["optimizers"].items():
        from executors.torch.pipeline_ops import new_optimizer

        stage = held.stages[index]
        stage.optimizer = new_optimizer(stage.module)
        stage.optimizer.load_state_dict(saved)  # its hyperparameters too: the saved ones win
    held.version = entry["version"]
