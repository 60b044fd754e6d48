"""The AdamW states of an FSDP stage's optimizer from a whole stage's, by name, cut to the rows
it steps [Note: FSDP checkpoints in executors/torch/fsdp_rows.py]."""

from __future__ import annotations

from collections.abc import Callable

import torch

from executors.torch.train.fsdp import StageShards, shard_rows

__all__ = ["load_named_states", "states_by_name"]


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
