"""A held model's part of an executor state in layout-free form, and back: its trained
parameters and AdamW states by the unsplit model's names, whatever the split that wrote them.

[Note: layout-free checkpoints] An executor saves each trained stage's parameters and the
AdamW states of the parameters its optimizer holds (one ZeRO-1 shard, or all) as tensors named
`MODEL/train/param/NAME` and `MODEL/train/optim/KEY/NAME`, NAME the unsplit name [Note: unsplit
names in weights.py]; the union of a checkpoint's files is the whole model, however its
stages, replicas and shards were cut. A resumed executor that trains a model keeps that union,
and each split of the model it builds then (in whatever stages the run's schedule cuts it)
is set from it (models/built.py, its generators kept: the build's seeding draws nothing); a
stage's optimizer takes its parameters' states when its first step makes it
(pipeline_ops._adamw_step), for whichever shard that step owns. A copy that generation holds
(`MODEL/copy{S}/param/NAME`) goes back only to the executor that saved it, and not when that
executor now trains the model in S stages: that split is the trained one (state._trained_here).
"""

from __future__ import annotations

from typing import Any

import torch

from executors.torch import weights
from executors.torch.errors import StageError
from executors.torch.fsdp_rows import fsdp_tensors, joined_rows, split_rows_name

__all__ = ["RESUMED", "fill_optimizer", "load_trained", "saved_model", "stage_states",
           "train_prefix", "trained_union"]

RESUMED = "resumed_models"  # ctx.state: model name -> its trained_union, after a resume

_JSON_TYPES = (int, float, bool, str, list, tuple, type(None))


def train_prefix(model: str) -> str:
    """Where a trained model's tensors are named in an executor state."""
    return f"{model}/train/"


def saved_model(name: str, stages: int, held: Any) -> tuple[dict, dict[str, torch.Tensor]]:
    """(its entry of plain values, its tensors by layout-free name) of held model `held`."""
    entry = {"name": name, "stages": stages, "config": held.config, "version": held.version,
             "trains": bool(held.stages), "shards": {}, "hyper": {}}
    tensors: dict[str, torch.Tensor] = {}
    if held.stages:
        for index, stage in sorted(held.stages.items()):
            _add_stage(tensors, entry, train_prefix(name), held, index, stage)
    elif held.version is not None:  # a copy loaded with weights: every part
        prefix = f"{name}/copy{stages}/param/"
        for index, part in enumerate(held.parts):
            _add_unique(tensors, prefix, weights.export(
                part, held.layout.check().names[index], trained_only=held.lora is not None))
    return entry, tensors


def _add_stage(tensors: dict, entry: dict, prefix: str, held: Any, index: int,
               stage: Any) -> None:
    names = held.layout.check().names[index]
    if stage.fsdp is not None and not stage.fsdp.gathered:  # its rows [Note: FSDP checkpoints]
        for kind, named in fsdp_tensors(stage.fsdp, stage.optimizer, names).items():
            tensors.update({f"{prefix}{kind}/{name}": value for name, value in named.items()})
        if stage.optimizer is not None:
            _add_hyper(entry, stage.optimizer)
        return
    _add_unique(tensors, prefix + "param/", weights.export(
        held.parts[index], names, trained_only=held.lora is not None))
    if stage.optimizer is None:
        return
    if stage.shard is not None:
        entry["shards"][str(index)] = list(stage.shard)
    local = _local_names(stage.module)
    _add_hyper(entry, stage.optimizer)
    for group in stage.optimizer.param_groups:
        for p in group["params"]:
            for key, value in stage.optimizer.state.get(p, {}).items():
                value = value if isinstance(value, torch.Tensor) else torch.tensor(value)
                tensors[f"{prefix}optim/{key}/{names[local[id(p)]]}"] = \
                    value.detach().to("cpu", copy=True)


def _add_hyper(entry: dict, optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        kind = "decay" if group["params"] and group["params"][0].dim() >= 2 else "plain"
        entry["hyper"][kind] = {k: v for k, v in group.items()
                                if k != "params" and isinstance(v, _JSON_TYPES)}


def _add_unique(tensors: dict, prefix: str, exported: dict[str, torch.Tensor]) -> None:
    """A tied weight under two names is one tensor: saved once (safetensors keeps no shared
    storage), found again under either name through the model's aliases."""
    seen: set[int] = set()
    for name, value in exported.items():
        if id(value) not in seen:
            seen.add(id(value))
            tensors[prefix + name] = value


def _local_names(module: torch.nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for local, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), local)
    return names


def trained_union(name: str, files: list[tuple[str, dict, dict]]) -> dict:
    """What the checkpoint's `files` ((path, entry, tensors), each holding trained weights of
    model `name`) hold of it between them: its parameters, AdamW states and hyperparameters by
    unsplit name, and its weights version (the first file's)."""
    prefix = train_prefix(name)
    found: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}
    hyper: dict[str, dict] = {}
    rows: dict[tuple[str, str | None], dict[int, torch.Tensor]] = {}  # FSDP replicas' rows
    for _, entry, tensors in files:
        hyper = {**entry["hyper"], **hyper}
        for key, value in tensors.items():
            if key.startswith(prefix + "param/"):
                name, first = split_rows_name(key[len(prefix) + 6:])
                if first is None:
                    found.setdefault(name, value)
                else:
                    rows.setdefault((name, None), {}).setdefault(first, value)
            elif key.startswith(prefix + "optim/"):
                state_key, _, unsplit = key[len(prefix) + 6:].partition("/")
                name, first = split_rows_name(unsplit)
                if first is None:
                    states.setdefault(name, {}).setdefault(state_key, value)
                else:
                    rows.setdefault((name, state_key), {}).setdefault(first, value)
    for (name, state_key), pieces in rows.items():  # [Note: FSDP checkpoints]
        joined = joined_rows(name, pieces)
        if state_key is None:
            found.setdefault(name, joined)
        else:
            states.setdefault(name, {}).setdefault(state_key, joined)
    return {"params": found, "states": states, "hyper": hyper,
            "version": files[0][1]["version"], "files": len(files)}


def load_trained(held: Any, name: str, union: dict) -> None:
    """Set every part of `held`, a split of trained model `name` built after a resume, from
    the checkpoint's `union` (trained_union), and keep the AdamW states aside for its stages'
    optimizers."""
    what = f"model {name!r} (from {union['files']} executor state(s) of the checkpoint)"
    found = union["params"]
    weights.load(held.parts, held.layout, found, complete=held.lora is None, what=what)
    if held.lora is not None:
        _check_adapters(held, found, what)
    held.resumed = {"states": union["states"], "hyper": union["hyper"]}
    held.version = union["version"]


def _check_adapters(held: Any, found: dict, what: str) -> None:
    adapters = [held.layout.names[index][local] for index, part in enumerate(held.parts)
                for local, p in part.named_parameters() if p.requires_grad]
    lacking = [name for name in adapters if _find(name, found, held.layout.aliases) is None]
    if lacking:
        raise StageError(f"{what}: no file holds adapters {sorted(lacking)[:3]}")


def _find(unsplit: str, given: dict, aliases: dict) -> Any:
    for name in (unsplit, *aliases.get(unsplit, ())):
        if name in given:
            return given[name]
    return None


def stage_states(held: Any, index: int) -> dict | None:
    """Stage `index`'s part of a resumed model's AdamW states ({local name: state}, and the
    groups' hyperparameters), for its optimizer once made; None when not resumed."""
    if held.resumed is None:
        return None
    states, aliases = held.resumed["states"], held.layout.aliases
    mine = {}
    for local, unsplit in held.layout.names[index].items():
        state = _find(unsplit, states, aliases)
        if state is not None:
            mine[local] = state
    return {"states": mine, "hyper": held.resumed["hyper"]}


def fill_optimizer(optimizer: torch.optim.Optimizer, module: torch.nn.Module,
                   resumed: dict) -> None:
    """Give a just-made optimizer the saved states of the parameters it holds, and the saved
    hyperparameters (they win, as a loaded state dict's do)."""
    fresh = optimizer.state_dict()
    local = _local_names(module)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {number: dict(resumed["states"][local[id(p)]]) for number, p in enumerate(params)
             if local[id(p)] in resumed["states"]}
    for number, saved in state.items():
        wrong = [key for key, value in saved.items()
                 if value.dim() > 0 and tuple(value.shape) != tuple(params[number].shape)]
        if wrong:
            raise StageError(f"the checkpoint's optimizer state {wrong[0]!r} of parameter "
                             f"{local[id(params[number])]!r} is {tuple(saved[wrong[0]].shape)}, "
                             f"the parameter {tuple(params[number].shape)}: the file is damaged")
    groups = []
    for group, made in zip(fresh["param_groups"], optimizer.param_groups, strict=True):
        kind = "decay" if made["params"] and made["params"][0].dim() >= 2 else "plain"
        groups.append({**group, **resumed["hyper"].get(kind, {}), "params": group["params"]})
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:
        raise StageError(f"the checkpoint's optimizer states do not fit this stage "
                         f"({str(exc).splitlines()[0][:200] if str(exc) else exc!r})") from None
