"""Data parallel over pipeline replicas: the process groups of a model's replicas and the
all-reduce of their gradients, through torch.distributed.

[Note: replica groups] A model trained as D replicas of a P-device pipeline has one process
group per device slot d: the D executors that hold device d of each replica. The controller
sets a group up once, before the model's first step (flowkit/runner/replicas.py):
`replica_store` on the group's rank 0 opens a TCPStore and returns where it listens;
`replica_group` on every member, given that address as an input (the controller never opens a
socket itself), joins a gloo group (NCCL on CUDA) under a prefix of its own. Gradients never
pass through the controller: the stage's last W starts its buckets ([Note: all-reduce in the
last W]) or, after the device's last action, `reduce_grads` does (`all_reduce_grads`), and
`reduce_grads` waits for them; the clipping norm and AdamW step that follow are the same on
every replica, so the replicas stay equal. Why the order holds: collectives must run in the
same order on every member, and each member runs its group's ops in its device's lane in the
order the controller submitted them, the same schedule to every replica. In full:
docs/training.md, "Data parallel × pipeline parallel".
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

import torch
import torch.distributed as dist

from executors.optable import OpContext
from executors.torch.errors import StageError
from executors.torch.process_groups import groups_joined

__all__ = ["BUCKET_BYTES", "BucketsInFlight", "all_reduce_grads", "broadcast_shards", "owned",
           "register"]

BUCKET_BYTES = 25 << 20  # torch DDP's default bucket size: few calls, each large enough to pay
_TIMEOUT_S = 600.0  # a member that does not arrive in this long fails the collective


def _replica_store(ctx: OpContext, *_: Any, group: str, size: int, host: str = "",
                   timeout_s: float = _TIMEOUT_S) -> dict:
    """Rank 0 of `group`: open its TCPStore on `host` (this executor's peer host) at a free
    port; returns {"host", "port"} for the other members."""
    stores = ctx.state.setdefault("replica_stores", {})
    host = host or "127.0.0.1"
    if group not in stores:
        listener = _listen_on(host)
        stores[group] = dist.TCPStore(host, listener.getsockname()[1], int(size),
                                      is_master=True, wait_for_workers=False,
                                      master_listen_fd=listener.detach(),
                                      timeout=datetime.timedelta(seconds=float(timeout_s)))
    return {"host": host, "port": int(stores[group].port)}


def _listen_on(host: str) -> socket.socket:
    """A socket listening on `host` alone at a free port, for the store to serve on: given
    only a port, TCPStore listens on every interface, and neither it nor gloo authenticates
    who connects (docs/security.md, data parallel's trust domain)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.bind(address)
    listener.listen(1024)
    return listener


def _replica_group(ctx: OpContext, address: Any, *_: Any, group: str, rank: int, size: int,
                   timeout_s: float = _TIMEOUT_S, weights: bool = False) -> int:
    """Join `group` as `rank` of `size` through the store at `address` (rank 0's
    `replica_store`); blocks until every member has joined. Returns the rank. A weight group
    (`weights`) [Note: weights by broadcast in executors/torch/weight_broadcast.py] is
    connected here, by one small broadcast: NCCL connects at a group's first collective, and
    a weight group's first is an export's, which its receivers join only once it has
    ended."""
    if not (isinstance(address, dict) and isinstance(address.get("port"), int)
            and 0 < address["port"] < 65536 and isinstance(address.get("host"), str)
            and 0 < len(address["host"]) <= 255):
        raise StageError(f"replica group {group!r}: expected the store's address as "
                         f"{{'host', 'port'}}, got {str(address)[:200]}")
    groups = groups_joined(ctx)
    if group in groups:
        return int(groups[group].rank())
    timeout = datetime.timedelta(seconds=float(timeout_s))
    store = ctx.state.get("replica_stores", {}).get(group)
    if store is None:
        store = dist.TCPStore(str(address["host"]), int(address["port"]), int(size),
                              is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"flowkit/{group}", store)
    if ctx.device.startswith("cuda"):
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        groups[group] = dist.ProcessGroupNCCL(prefixed, int(rank), int(size), options)
    else:
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=str(address["host"]))]
        options._timeout = timeout
        groups[group] = dist.ProcessGroupGloo(prefixed, int(rank), int(size), options)
    if weights:
        ctx.state.setdefault("weight_groups", set()).add(group)
        probe = torch.zeros(1, device=ctx.device if ctx.device.startswith("cuda") else "cpu")
        groups[group].broadcast(probe, 0).wait()
    return int(rank)


def _leave_replica_groups(ctx: OpContext, *_: Any, groups: list | None = None) -> int:
    """Drop the named groups this executor is in (a run on executors that outlive it ends);
    returns how many it was in."""
    held, stores = groups_joined(ctx), ctx.state.get("replica_stores", {})
    left = 0
    for name in groups or ():
        left += held.pop(str(name), None) is not None
        stores.pop(str(name), None)
        ctx.state.get("weight_sends", {}).pop(str(name), None)  # [Note: weights by broadcast]
        ctx.state.get("weight_groups", set()).discard(str(name))
    return left


def replica_group(ctx: OpContext, group: str) -> Any:
    """The process group `group` this executor joined, or a clear error."""
    found = groups_joined(ctx).get(group)
    if found is None:
        raise StageError(f"this executor is in no replica group {group!r}: the runner sets "
                         "each group up before the model's first step (replica_group)")
    return found


def all_reduce_grads(group: Any, params: list[torch.Tensor],
                     bucket_bytes: int = BUCKET_BYTES, *, reverse: bool = False) -> None:
    """Sum the gradients of `params` over `group`, in place: flattened into buckets of one
    dtype up to `bucket_bytes`, every bucket's all-reduce in flight before the first is waited
    on, so gloo's threads (or NCCL's stream) overlap them. A parameter without a gradient
    takes part with zeros (another replica may have one: a replica with no microbatch)."""
    buckets = BucketsInFlight(group, params, bucket_bytes, reverse=reverse)
    buckets.finish()
    buckets.wait()


class BucketsInFlight:
    """[Note: all-reduce in the last W] A stage's gradient all-reduce started from inside its
    device's last W (or BW) of the step: the op tells `mark_final(params)` as each deferred call's
    gradients are done for good, and each bucket starts (async, gloo's threads or NCCL's
    stream) once it and every bucket before it are final, so every replica starts the same
    buckets in the same order (`all_reduce_grads` too: the same cut, the same sums, bit for
    bit); `finish` starts the rest as the op ends. `reverse`: the last bucket first, for a fused
    BW, whose backward pass makes the last layers' gradients first (the runner picks one order
    per stage for every replica). The stage's `reduce_grads` then only waits and copies back.
    A device holding two stages (ZB-V) does this only where every replica ends them in one
    order, and its reduce_grads follow that order (flowkit/runner/replicas.py,
    `agreed_devices`): they share one replica group. The planner's model: [Note: overlapped
    all-reduce]."""

    def __init__(self, group: Any, params: list[torch.Tensor],
                 bucket_bytes: int = BUCKET_BYTES, *, reverse: bool = False) -> None:
        self.group = group
        self.buckets = _buckets(params, bucket_bytes)
        self.order = self.buckets[::-1] if reverse else self.buckets  # the start order
        self.final_ids: set[int] = set()  # ids of the parameters whose gradients are final
        self.pending: list[tuple[list[torch.Tensor], torch.Tensor, Any]] = []

    def final_except(self, touched: list[torch.Tensor]) -> None:
        """Everything but `touched` is final already: the op adds to those alone."""
        later = {id(p) for p in touched}
        self.mark_final(p for p in self._params() if id(p) not in later)

    def mark_final(self, params: Any) -> None:
        self.final_ids.update(id(p) for p in params)
        while len(self.pending) < len(self.order) and all(
                id(p) in self.final_ids for p in self._tensors(self.order[len(self.pending)])):
            self._start(self.order[len(self.pending)])

    def finish(self) -> None:
        self.mark_final(self._params())

    @property
    def started(self) -> int:
        return len(self.pending)

    def wait(self) -> None:
        """Wait for every bucket (all started: `finish` first) and copy the sums back."""
        self._check_started()
        for bucket, flat, work in self.pending:
            work.wait()
            _unflatten(flat, [p.grad for p in bucket])

    def _check_started(self) -> None:
        if len(self.pending) != len(self.buckets):
            raise StageError(f"{len(self.buckets) - len(self.pending)} of {len(self.buckets)} "
                             "gradient buckets never started: the op that ends the stage's "
                             "backward did not finish them")

    def _params(self) -> list[torch.Tensor]:
        """Every parameter whose gradient it sums."""
        return [p for bucket in self.buckets for p in self._tensors(bucket)]

    @staticmethod
    def _tensors(bucket: list) -> list[torch.Tensor]:
        """A bucket's parameters (a subclass's buckets may hold other records of them)."""
        return bucket

    def discard(self) -> None:
        """Let the buckets started go, their sums unread: a later backprop of the step adds
        to the gradients, so the stage's reduce_grads sums them anew. Every replica discards
        the same ones (its W ops are told the same), so the group's collectives still match."""
        for _, _, work in self.pending:
            work.wait()
        self.pending = []

    def _start(self, bucket: list[torch.Tensor]) -> None:
        for param in bucket:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        self.pending.append((bucket, flat, self.group.allreduce([flat])))


# [Note: sharded optimizer states] With `shard_optimizer` (ZeRO stage 1), each replica of a
# stage keeps AdamW states only for the parameters it owns: the stage's parameters in order, each
# to the rank that owns the fewest elements so far (the same cut on every replica). After the
# gradients are summed and clipped as without sharding, each rank steps its own parameters and
# then broadcasts them to the others, owner by owner. AdamW updates each element from its own
# gradient and state alone, so the result is the unsharded step's, bit for bit.
def owned(params: list[torch.Tensor], rank: int, size: int) -> list[torch.Tensor]:
    """The parameters of `params` that `rank` of `size` owns [Note: sharded optimizer states]."""
    return [p for p, owner in zip(params, _owners(params, size), strict=True) if owner == rank]


def _owners(params: list[torch.Tensor], size: int) -> list[int]:
    loads = [0] * size
    owners = []
    for param in params:
        owner = min(range(size), key=lambda r: (loads[r], r))
        loads[owner] += param.numel()
        owners.append(owner)
    return owners


def broadcast_shards(group: Any, params: list[torch.Tensor],
                     bucket_bytes: int = BUCKET_BYTES) -> None:
    """Every rank's owned parameters of `params`, as its optimizer stepped them, to all ranks
    [Note: sharded optimizer states]: bucketed, all in flight before the first is waited on."""
    owners = _owners(params, group.size())
    pending = []
    for rank in range(group.size()):
        mine = [p for p, owner in zip(params, owners, strict=True) if owner == rank]
        for bucket in _buckets(mine, bucket_bytes):
            flat = torch.cat([p.detach().reshape(-1) for p in bucket])
            pending.append((bucket, flat, group.broadcast(flat, rank)))
    with torch.no_grad():
        for bucket, flat, work in pending:
            work.wait()
            _unflatten(flat, bucket)


def _unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy a bucket's flat result back into the tensors it was concatenated from."""
    offset = 0
    for tensor in tensors:
        count = tensor.numel()
        tensor.copy_(flat[offset:offset + count].view_as(tensor))
        offset += count


def _buckets(params: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive parameters of one dtype and device, each bucket up to `limit` bytes (a
    larger parameter alone)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for param in params:
        nbytes = param.numel() * param.element_size()
        last = buckets[-1] if buckets else None
        if (last is None or size + nbytes > limit or last[0].dtype != param.dtype
                or last[0].device != param.device):
            buckets.append([param])
            size = nbytes
        else:
            last.append(param)
            size += nbytes
    return buckets


def register(table: Any) -> None:
    table.register("replica_store", _replica_store)
    table.register("replica_group", _replica_group)
    table.register("leave_replica_groups", _leave_replica_groups)
