"""Re-cutting a stage's AdamW states for another replica count [Note: sharded optimizer states
in executors/torch/train/replicas.py]: a checkpoint's shards (or its whole state) merged per
parameter, then cut again for the shard this replica owns now (or kept whole).

An AdamW state dict numbers its parameters in the order of its param groups, and the optimizer
step builds its groups as matrices (decayed) then the rest (`_adamw` in pipeline_ops.py), from
the parameters a shard owns (`owned`): so a saved shard's k-th number is the k-th parameter of
that order, which the module the executor built again names without reading the file.
"""

from __future__ import annotations

import torch

from executors.torch.errors import StageError
from executors.torch.train.replicas import owned

__all__ = ["recut"]


def recut(params: list[torch.Tensor], saved: list[tuple[tuple[int, int] | None, dict]],
          target: tuple[int, int] | None, fresh: dict) -> dict:
    """The state dict for `target` (rank, size), or the whole stage for None, from `saved`:
    every saved shard of the stage as ((rank, size), state dict), or the one whole state as
    (None, state dict). `fresh` is the target optimizer's own (empty) state dict, whose param
    groups the saved hyperparameters fill in."""
    states: dict[int, dict] = {}  # position in `params` -> its AdamW state
    hyper: dict[bool, dict] = {}  # decayed or not -> the saved group's hyperparameters
    for shard, state in saved:
        order = _order(params, shard)
        groups, per_param = state.get("param_groups"), state.get("state")
        if not (isinstance(groups, list) and all(isinstance(g, dict) for g in groups)
                and all(isinstance(g.get("params"), list) for g in groups)
                and isinstance(per_param, dict)):
            raise StageError(f"a saved optimizer shard {shard} is not an AdamW state dict "
                             "(param_groups with params, and per-parameter state)")
        for group in groups:
            for number in group["params"]:
                if not isinstance(number, int) or not 0 <= number < len(order):
                    raise StageError(f"a saved optimizer shard {shard} numbers parameter "
                                     f"{number!r}, outside its {len(order)}")
                position = order[number]
                hyper[params[position].dim() >= 2] = {k: v for k, v in group.items()
                                                      if k != "params"}
                if number in per_param:
                    states[position] = per_param[number]
    mine = _order(params, target)
    groups = []
    for group in fresh["param_groups"]:
        decayed = params[mine[group["params"][0]]].dim() >= 2 if group["params"] else True
        groups.append({**group, **hyper.get(decayed, {}), "params": list(group["params"])})
    return {"state": {number: states[position] for number, position in enumerate(mine)
                      if position in states},
            "param_groups": groups}


def _order(params: list[torch.Tensor], shard: tuple[int, int] | None) -> list[int]:
    """Positions in `params` of a shard's (or the whole stage's) parameters, in its optimizer's
    numbering: matrices, then the rest."""
    position = {id(p): i for i, p in enumerate(params)}
    chosen = params if shard is None else owned(params, *shard)
    ordered = [p for p in chosen if p.dim() >= 2] + [p for p in chosen if p.dim() < 2]
    return [position[id(p)] for p in ordered]
