"""The torch.distributed process groups an executor joined, by name: its replicas' [Note: replica
groups in executors/torch/train/replicas.py] and its weight groups' [Note: weights by broadcast
in executors/torch/weight_broadcast.py]."""

from __future__ import annotations

from typing import Any

from executors.optable import OpContext

__all__ = ["groups_joined"]


def groups_joined(ctx: OpContext) -> dict[str, Any]:
    """The process groups this executor joined (the replica_group op), by name."""
    return ctx.state.setdefault("replica_groups", {})
