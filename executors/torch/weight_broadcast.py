"""Weights from a trainer to the executors that generate with them through a process group:
GPU to GPU over NCCL, through gloo on CPUs [Note: weights by broadcast].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from executors.optable import OpContext
from executors.torch import weights
from executors.torch.errors import StageError
from executors.torch.process_groups import groups_joined
from flowkit.ops.records import BroadcastWeights

__all__ = ["received", "send"]

# [Note: weights by broadcast] Across GPUs a sync through the host copies the weights down,
# through the data plane and up again. Instead each stage of the trained model gets a process
# group (NCCL on GPUs, gloo on CPUs; joined, and connected, with the replica groups' ops):
# rank 0 its exporter, the others the executors that load it. The export packs the stage into
# one buffer, starts its broadcast without waiting for it (its receivers start only once the
# export has ended) and returns a BroadcastWeights record; each load receives the buffers of
# the records it is given, in stage order. A group's broadcasts go in order on both sides (its
# receivers' loads run in one lane); the exporter drops a buffer at its next export once its
# broadcast is done and, where it loads the stage itself, that load took it (a record names
# its buffer by serial). It never waits for its receivers. `--weight-sync` picks it
# (auto: where every member of a stage's group has a GPU of its own); the tests run it on gloo.
_KEPT_FOR_SELF = 2  # buffers an exporter keeps for its own load: the newest and one before


@attrs.define
class _Sent:
    serial: int
    flat: torch.Tensor
    work: Any  # the broadcast in flight; None with no receivers
    for_self: bool  # the exporter loads this stage too

    def settled(self) -> bool:
        return not self.for_self and (self.work is None or self.work.is_completed())


def send(ctx: OpContext, params: Sequence[torch.Tensor], named: Sequence[tuple[str, int]],
         group_name: str, *, for_self: bool = False) -> BroadcastWeights:
    """`params` packed into one buffer and broadcast, from this executor as rank 0, to the rest
    of `group_name`; `named`: each unsplit name and its parameter's index (weights.exported);
    `for_self`: this executor loads the stage too (it keeps the buffer for that load)."""
    group = _group(ctx, group_name)
    if group.rank() != 0:
        raise StageError(f"weight group {group_name!r}: this executor is its rank "
                         f"{group.rank()}; only rank 0, the stage's exporter, sends")
    sent = ctx.state.setdefault("weight_sends", {}).setdefault(group_name, [])
    sent[:] = [s for s in sent if not s.settled()]
    own = [s for s in sent if s.for_self]
    for stale in own[:-(_KEPT_FOR_SELF - 1)]:  # a load that never came: not kept forever
        sent.remove(stale)
    serials = ctx.state.setdefault("weight_serials", {})
    serial = serials[group_name] = serials.get(group_name, -1) + 1
    flat, entries = weights.packed_copy(params, named)
    work = group.broadcast(flat, 0) if group.size() > 1 else None
    sent.append(_Sent(serial=serial, flat=flat, work=work, for_self=bool(for_self)))
    return BroadcastWeights(group=group_name, serial=serial, size=int(flat.numel()),
                            tensors=entries)


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

    if type(record.group) is not str or type(record.serial) is not int \
            or type(record.size) is not int or not 0 < record.size <= limit:
        raise bad(f"the group must be named, the serial an integer and the size 1..{limit} "
                  "bytes (this model's)")
    places = weights.checked_places(record.tensors, record.size, bad)
    group = _group(ctx, record.group)
    if group.rank() == 0:
        flat = _own_buffer(ctx, record, bad)
    else:
        flat = torch.empty(record.size, dtype=torch.uint8, device=device)
        group.broadcast(flat, 0).wait()
    views = weights.packed_views(flat, [place for _, place in places])
    return {name: view for (name, _), view in zip(places, views)}


def _own_buffer(ctx: OpContext, record: BroadcastWeights, bad) -> torch.Tensor:
    sent = ctx.state.get("weight_sends", {}).get(record.group, [])
    for entry in sent:
        if entry.serial == record.serial and entry.flat.numel() == record.size:
            entry.for_self = False  # taken: it goes once its broadcast is done
            return entry.flat
    raise bad(f"this executor holds no buffer {record.serial} of it (it keeps its last "
              f"{_KEPT_FOR_SELF} for its own loads)")


def _group(ctx: OpContext, name: Any) -> Any:
    """A weight group this executor joined: never a replica group, whose collectives a record
    naming it would disturb."""
    known = type(name) is str and name in ctx.state.get("weight_groups", ())
    group = groups_joined(ctx).get(name) if known else None
    if group is None:
        raise StageError(f"this executor is in no weight group {str(name)[:120]!r}: the runner "
                         "sets one up for each stage before the first sync that broadcasts")
    return group
