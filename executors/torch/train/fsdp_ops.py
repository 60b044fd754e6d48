"""The torch executor's inspection ops of a trained stage's state: its FSDP share and the bytes
its parameters, gradients and optimizer states take [Note: FSDP within a stage in
executors/torch/train/fsdp.py]."""

from __future__ import annotations

from typing import Any

import torch

from executors.optable import OpContext, OpTable
from executors.torch.errors import StageError
from executors.torch.train.fsdp import check_shardable, gather, shards_of
from executors.torch.train.held_stage import held_stage

__all__ = ["register"]


def _fsdp_shards(ctx: OpContext, *_: Any, stage: int, stages: int, **config: Any) -> dict:
    """This replica's share of an FSDP stage (executors/torch/train/fsdp.py, `shards_of`):
    every replica's, given to `full_stage_state`, make the stage's whole state."""
    held = held_stage(ctx, {**config, "stage": stage, "stages": stages})
    if held.fsdp is None:
        raise StageError(f"stage {stage} of model {config.get('model', '')!r} is not sharded "
                         "here: FSDP cuts a stage at its first reduce_grads (shard='fsdp')")
    return shards_of(held.fsdp, held.optimizer)


def _check(ctx: OpContext, *_: Any, stage: int, stages: int, replicas: int,
           **config: Any) -> None:
    """Before a model's first ops: refuse a stage FSDP would find nothing to shard in."""
    held = held_stage(ctx, {**config, "stage": stage, "stages": stages})
    check_shardable(held.module, held.tied, int(replicas),
                    f"model {config.get('model', '')!r} stage {stage}")


def _gather(ctx: OpContext, *_: Any, stage: int, stages: int, **config: Any) -> None:
    """Make an FSDP stage whole here, with every replica of it, for an export to read."""
    held = held_stage(ctx, {**config, "stage": stage, "stages": stages})
    if held.fsdp is not None:
        gather(held.fsdp)


def _state_bytes(ctx: OpContext, *_: Any, stage: int, stages: int, **config: Any) -> dict:
    """{params, grads, optimizer}: the bytes this executor keeps of the stage between steps
    (its parameters, and its optimizer's states), and those of the gradients its optimizer
    steps (one per parameter it steps, as large): what sharding cuts."""
    held = held_stage(ctx, {**config, "stage": stage, "stages": stages})
    params = list(held.module.parameters())
    stepped = list(held.fsdp.optimized()) if held.fsdp is not None else \
        [p for group in (held.optimizer.param_groups if held.optimizer else ())
         for p in group["params"]]
    if held.fsdp is not None:
        params += [s.rows for s in held.fsdp.sharded]
    states = held.optimizer.state.values() if held.optimizer is not None else ()
    return {"params": _bytes(params), "grads": _bytes(stepped),
            "optimizer": _bytes(t for state in states for t in state.values()
                                if isinstance(t, torch.Tensor))}


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def register(table: OpTable) -> None:
    table.register("fsdp_shards", _fsdp_shards)
    table.register("fsdp_gather", _gather)
    table.register("fsdp_check", _check)
    table.register("stage_state_bytes", _state_bytes)
