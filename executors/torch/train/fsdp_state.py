"""Checkpoints of FSDP stages [Note: FSDP within a stage in executors/torch/train/fsdp.py], kept
in one place for the state file's format to call.

[Note: FSDP checkpoints] Each replica saves its share of an FSDP stage (`shards_of`: its rows
of the parameters and AdamW states, the whole ones) under the model entry's "fsdp", in place of
the stage's parts and optimizer. A load joins the shares of every saved replica of its device
(the checkpoint's files, as ZeRO-1's resume reads them) into the stage's whole parameters and
per-parameter states (`full_stage_state`): the parameters load into the module, and the states
wait on the stage until its optimizer is made, then are cut for the rows it steps there. So a
checkpoint resumes at any replica count, with FSDP or without.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from executors.torch.errors import StageError
from executors.torch.train.fsdp import StageShards, full_stage_state, shard_rows, shards_of

__all__ = ["fsdp_shares", "join_saved_shares", "load_named_states", "restore_whole",
           "states_by_name"]


def fsdp_shares(stages: dict[int, Any]) -> dict[int, dict]:
    """Each FSDP stage's share held here, by stage index (HeldStages by index)."""
    return {i: shards_of(s.fsdp, s.optimizer) for i, s in stages.items() if s.fsdp is not None}


def join_saved_shares(entry: dict, peer_entries: Iterable[dict], path: str) -> dict[int, tuple]:
    """{stage: (whole parameters, per-parameter optimizer states)} of the FSDP stages in
    `entry`, joined from the same model's entries in the device's saved files."""
    wanted = entry.get("fsdp") or {}
    if not isinstance(wanted, dict):
        raise StageError(f"{path}: model {entry['name']!r} has an fsdp record that is not "
                         "{stage: share}: the file is damaged or not flowkit's")
    found: dict[int, dict[int, dict]] = {index: {} for index in wanted}
    for other in peer_entries:
        for index, share in (other.get("fsdp") or {}).items():
            if index in found and isinstance(share, dict):
                found[index][int(share.get("rank", -1))] = share
    joined = {}
    for index, shares in found.items():
        size = int(wanted[index].get("size", 0))
        if sorted(shares) != list(range(size)):
            raise StageError(f"{path}: model {entry['name']!r} stage {index} was saved as FSDP "
                             f"shares over {size} replicas, and the checkpoint's files of this "
                             f"device hold ranks {sorted(shares)}: resume from a complete "
                             "checkpoint")
        joined[index] = full_stage_state(list(shares.values()))
    return joined


def restore_whole(module: torch.nn.Module, params: dict[str, torch.Tensor], where: str) -> None:
    """Load a stage's whole parameters by name; every saved name must be one of the stage's."""
    own = dict(module.named_parameters())
    unknown = sorted(set(params) - set(own))
    if unknown:
        raise StageError(f"{where}: the checkpoint's FSDP shares name parameters this stage "
                         f"does not have ({', '.join(unknown[:5])}): resume with the flow "
                         "that wrote it")
    with torch.no_grad():
        for name, value in params.items():
            if tuple(value.shape) != tuple(own[name].shape):
                raise StageError(f"{where}: parameter {name!r} was saved as "
                                 f"{tuple(value.shape)}, this stage has {tuple(own[name].shape)}")
            own[name].copy_(value)


def load_named_states(optimizer: torch.optim.Optimizer, named: dict[str, torch.Tensor],
                      states: dict[str, dict], shards: StageShards | None) -> None:
    """Give `optimizer` the saved per-parameter `states` of the parameters it steps (`named`:
    each by its name), cut to this rank's rows where `shards` steps rows."""
    rows = {id(s.rows): s.name for s in shards.sharded} if shards is not None else {}
    names = {id(p): n for n, p in named.items()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = rows.get(id(param)) or names.get(id(param))
            saved = states.get(name) if name is not None else None
            if saved:
                cut = _cut(shards) if id(param) in rows else (lambda t: t)
                optimizer.state[param] = _on(param, saved, cut)


def states_by_name(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> dict:
    """`optimizer`'s per-parameter states by `module`'s names: a whole stage's states (a
    checkpoint saved without FSDP) to be cut for the rows FSDP steps."""
    return {name: dict(optimizer.state[p]) for name, p in module.named_parameters()
            if p in optimizer.state}


def _cut(shards: StageShards) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: shard_rows(t, shards.rank, shards.size) if t.dim() > 0 else t


def _on(param: torch.Tensor, saved: dict, cut: Callable) -> dict:
    """A saved AdamW state for `param`: row tensors on its device in its dtype; `step`, a
    scalar, where and as AdamW keeps it."""
    out = {}
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            value = cut(value).clone()
            if value.dim() > 0:
                value = value.to(param.device, param.dtype)
        out[key] = value
    return out
