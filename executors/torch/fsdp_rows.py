"""An FSDP stage's rows in a layout-free checkpoint ([Note: FSDP within a stage] in
executors/torch/train/fsdp.py, [Note: layout-free checkpoints] in executors/torch/layout_free.py).

[Note: FSDP checkpoints] Between steps an FSDP replica holds only its rows of each sharded
parameter and their AdamW states. It saves them as they are, each under the parameter's unsplit
name and the row they start at (`NAME@rows=FIRST`); the parameters it keeps whole, under their
names alone. A resume joins every file's rows of a name in row order (`joined_rows`, checking
that they tile the parameter), so the union is the whole model as without FSDP, and resumes at
any replica count, with FSDP or without. Its stage's optimizer, made at the first step, takes
the whole states by name cut to the rows it steps (`load_named_states` in train/fsdp_state.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from executors.torch.errors import StageError

__all__ = ["ROWS", "fsdp_tensors", "joined_rows", "split_rows_name"]

ROWS = "@rows="  # [Note: FSDP checkpoints]: NAME@rows=FIRST, a replica's rows from FIRST on


def fsdp_tensors(shards: Any, optimizer: torch.optim.Optimizer | None,
                 names: dict[str, str]) -> dict[str, dict[str, torch.Tensor]]:
    """{"param": {name: tensor}, "optim/KEY": {name: tensor}} of this replica's share (a
    train.fsdp.StageShards) on the host, `names` mapping the stage's local names to unsplit
    ones [Note: FSDP checkpoints]."""
    states = optimizer.state if optimizer is not None else {}
    out: dict[str, dict[str, torch.Tensor]] = {"param": {}}
    pieces = [(f"{names[s.name]}{ROWS}{shards.rank * math.ceil(s.shape[0] / shards.size)}",
               s.rows) for s in shards.sharded if s.rows.size(0)]
    pieces += [(names[local], param) for local, param in shards.whole]
    for name, param in pieces:
        out["param"][name] = param.detach().to("cpu", copy=True)
        for key, value in states.get(param, {}).items():
            value = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            out.setdefault(f"optim/{key}", {})[name] = value.detach().to("cpu", copy=True)
    return out


def split_rows_name(name: str) -> tuple[str, int | None]:
    """(unsplit name, first row) of a saved tensor's name; None for a whole tensor."""
    base, found, first = name.partition(ROWS)
    if not found:
        return name, None
    if not first.isdigit():
        raise StageError(f"a checkpoint tensor is named {name!r}: rows must start at a row "
                         "number; the file is damaged or not flowkit's")
    return base, int(first)


def joined_rows(name: str, pieces: dict[int, torch.Tensor]) -> torch.Tensor:
    """One parameter (or AdamW state) from the FSDP replicas' rows of it, by first row; a
    scalar state (AdamW's step) is the same on every replica."""
    ordered = sorted(pieces.items())
    if ordered[0][1].dim() == 0:
        return ordered[0][1]
    head = ordered[0][1]
    row = 0
    for first, piece in ordered:
        if piece.dim() == 0 or piece.shape[1:] != head.shape[1:] or piece.dtype != head.dtype:
            raise StageError(f"the checkpoint's FSDP rows of {name!r} differ in shape or dtype "
                             f"({tuple(head.shape)} {head.dtype}, {tuple(piece.shape)} "
                             f"{piece.dtype}): the files are damaged or not one run's")
        if first != row:
            raise StageError(f"the checkpoint's FSDP rows of {name!r} start at "
                             f"{[f for f, _ in ordered]}, which do not tile it: resume from a "
                             "complete checkpoint")
        row += piece.size(0)
    return torch.cat([piece for _, piece in ordered])
