"""Weights from a trainer to the executors that generate with them through a process group:
GPU to GPU over NCCL, through gloo on CPUs [Note: weights by broadcast].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from executors.optable import OpContext
from executors.torch import weights
from executors.torch.errors import StageError
from executors.torch.process_groups import groups_joined
from flowkit.ops.records import BroadcastWeights

__all__ = ["received", "send"]

# [Note: weights by broadcast] Across GPUs a sync through the host copies the weights down,
# through the data plane and up again. Instead each stage of the trained model gets a process
# group (set up at the first sync with the replica groups' ops; NCCL on GPUs, gloo on CPUs):
# rank 0 its exporter, the others the executors that load it. The export packs the stage into
# one buffer, starts its broadcast without waiting (a load that has not begun must not block
# the exporter) and returns a BroadcastWeights record; each load receives the buffers of the
# records it is given, in stage order, and copies from them. The exporter keeps its buffer until
# its next export of the stage, which first waits for this broadcast; a loader that is the
# exporter takes the buffer itself. A target's loads of one model run in one lane, so a group's
# broadcasts meet in the order they were sent. `--weight-sync` picks it (auto: where every
# member of a stage's group has a GPU of its own); the tests run it on gloo.


def send(ctx: OpContext, params: Sequence[torch.Tensor], named: Sequence[tuple[str, int]],
         group_name: str) -> BroadcastWeights:
    """`params` packed into one buffer and broadcast, from this executor as rank 0, to the rest
    of `group_name`; `named`: each unsplit name and its parameter's index (weights.exported)."""
    group = _group(ctx, group_name)
    if group.rank() != 0:
        raise StageError(f"weight group {group_name!r}: this executor is its rank "
                         f"{group.rank()}; only rank 0, the stage's exporter, sends")
    sends = ctx.state.setdefault("weight_sends", {})
    previous = sends.pop(group_name, None)
    if previous is not None and previous[0] is not None:
        previous[0].wait()  # the receivers have the last one: its buffer may go
    flat, entries = weights.packed_copy(params, named)
    sends[group_name] = (group.broadcast(flat, 0) if group.size() > 1 else None, flat)
    return BroadcastWeights(group=group_name, size=int(flat.numel()), tensors=entries)


def received(ctx: OpContext, record: Any, device: torch.device, limit: int
             ) -> dict[str, torch.Tensor]:
    """The weights `record` announces, by unsplit name: received from its group's rank 0 (or,
    on rank 0, its own buffer), once its fields are checked; `limit`: the most bytes this
    executor takes (its model's, at 8 bytes a weight)."""
    if not isinstance(record, BroadcastWeights):
        raise StageError(f"expected BroadcastWeights, got a {type(record).__name__}")

    def bad(what: str) -> StageError:
        return StageError(f"broadcast weights (group {str(record.group)[:120]!r}): {what}; "
                          "refusing to receive them")

    if type(record.group) is not str or type(record.size) is not int \
            or not 0 < record.size <= limit:
        raise bad(f"the group must be named and the size 1..{limit} bytes (this model's)")
    places = weights.checked_places(record.tensors, record.size, bad)
    group = _group(ctx, record.group)
    if group.rank() == 0:
        sent = ctx.state.get("weight_sends", {}).get(record.group)
        if sent is None or sent[1].numel() != record.size:
            raise bad("this executor sent no such buffer")
        flat = sent[1]
    else:
        flat = torch.empty(record.size, dtype=torch.uint8, device=device)
        group.broadcast(flat, 0).wait()
    views = weights.packed_views(flat, [place for _, place in places])
    return {name: view for (name, _), view in zip(places, views)}


def _group(ctx: OpContext, name: Any) -> Any:
    group = groups_joined(ctx).get(name) if type(name) is str else None
    if group is None:
        raise StageError(f"this executor is in no weight group {str(name)[:120]!r}: the runner "
                         "sets one up for each stage before the first sync that broadcasts")
    return group
