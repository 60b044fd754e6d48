"""FSDP within a stage: a stage's parameters, gradients and optimizer states sharded over its
replica group.

[Note: FSDP within a stage] With `Model(shard="fsdp")` each replica of a stage keeps, between
steps, only its rows of each parameter (dim 0 cut in D even chunks, FSDP2's Shard(0) layout),
their gradient and their AdamW states. The stage's first F of a step all-gathers the whole
parameters (same objects, new `.data`: the recorder and autograd see the weights they always
see, so F, B, W and BW run unchanged); the gradients are reduce-scattered (each rank gets
the sum of its rows), from the second step started inside the stage's last W (ShardsInFlight),
and `reduce_grads`, after the stage's last action on every replica, frees the whole
parameters and gradients. Tied copies and parameters with fewer rows than replicas stay
whole on every replica and are all-reduced as without FSDP. torch's `fully_shard` is not used:
it needs a DeviceMesh over the default process group, and an executor here is in several
replica groups at once (executors/torch/train/replicas.py) and has no default group. In full:
docs/training.md, "FSDP within a stage".
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

from executors.torch.errors import StageError
from executors.torch.train.replicas import BUCKET_BYTES, BucketsInFlight, all_reduce_grads

__all__ = ["ShardedParam", "ShardsInFlight", "StageShards", "check_shardable",
           "full_stage_state", "gather", "reduce_and_release", "shard_rows", "shard_stage",
           "sharded_squared_norm", "shards_of"]


@attrs.define(eq=False)
class ShardedParam:
    name: str
    param: torch.nn.Parameter  # the module's: whole within a step, empty between steps
    rows: torch.nn.Parameter  # this rank's rows, a leaf the optimizer steps
    shape: tuple[int, ...]  # the whole parameter's


@attrs.define(eq=False)
class StageShards:
    """One replica's share of an FSDP stage [Note: FSDP within a stage]."""

    group: Any
    sharded: list[ShardedParam]
    whole: list[tuple[str, torch.nn.Parameter]]  # kept whole on every replica
    gathered: bool = True  # the module's sharded parameters hold their whole values now

    @property
    def rank(self) -> int:
        return int(self.group.rank())

    @property
    def size(self) -> int:
        return int(self.group.size())

    def optimized(self) -> list[torch.nn.Parameter]:
        """What this replica's optimizer steps: its rows, then the whole parameters."""
        return [s.rows for s in self.sharded] + [p for _, p in self.whole]

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.optimized() if p.grad is not None]

    def zero_grad(self) -> None:
        for param in self.optimized():
            param.grad = None


def shard_rows(tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s rows of `tensor` cut in `size` chunks of ceil(rows / size) (the last ones
    shorter or empty), as torch.chunk and FSDP2 cut them."""
    chunk = math.ceil(tensor.size(0) / size)
    return tensor[rank * chunk:(rank + 1) * chunk]


def check_shardable(module: torch.nn.Module, tied: tuple[str, ...], size: int,
                    where: str) -> None:
    """Refuse a stage with nothing to shard over `size` replicas: FSDP would save nothing."""
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not any(_shardable(n, p, tied, size) for n, p in trainable):
        names = ", ".join(n for n, _ in trainable) or "none"
        raise StageError(f"{where}: FSDP over {size} replicas finds no parameter to shard "
                         f"(trainable: {names}; each needs at least {size} rows and no tied "
                         "copy): train this model without shard='fsdp' (--fsdp)")


def _shardable(name: str, param: torch.Tensor, tied: tuple[str, ...], size: int) -> bool:
    return name not in tied and param.dim() > 0 and param.size(0) >= size


def shard_stage(group: Any, module: torch.nn.Module, tied: tuple[str, ...],
                where: str) -> StageShards:
    """Cut `module`'s trainable parameters over `group`; the whole parameters stay gathered
    until `reduce_and_release`."""
    rank, size = int(group.rank()), int(group.size())
    check_shardable(module, tied, size, where)
    sharded, whole = [], []
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        if not _shardable(name, param, tied, size):
            whole.append((name, param))
        else:
            rows = torch.nn.Parameter(shard_rows(param.detach(), rank, size).clone())
            sharded.append(ShardedParam(name=name, param=param, rows=rows,
                                        shape=tuple(param.shape)))
    return StageShards(group=group, sharded=sharded, whole=whole)


def gather(shards: StageShards) -> None:
    """Every sharded parameter whole again, from every rank's rows (all in flight at once)."""
    if shards.gathered:
        return
    size, pending = shards.size, []
    for shard in shards.sharded:
        # allgather takes equal parts: the short last chunks padded with zero rows
        padded = shard.rows.detach().new_zeros((math.ceil(shard.shape[0] / size),
                                                *shard.shape[1:]))
        padded[:shard.rows.size(0)] = shard.rows.detach()
        parts = [torch.empty_like(padded) for _ in range(size)]
        pending.append((shard, parts, shards.group.allgather([parts], [padded])))
    for shard, parts, work in pending:
        work.wait()
        shard.param.data = torch.cat(parts)[:shard.shape[0]]
    shards.gathered = True


def reduce_and_release(shards: StageShards) -> None:
    """Sum the gradients over the group: each rank gets the sum of its rows of the sharded ones
    (a reduce-scatter, half an all-reduce's traffic) and the whole ones whole; then free the
    whole parameters and gradients until the next step's first F."""
    all_reduce_grads(shards.group, [p for _, p in shards.whole])
    pending = [_reduce_scatter(shards, bucket) for bucket in _buckets(shards.sharded)]
    _keep_and_release(shards, pending)


def _keep_and_release(shards: StageShards, pending: list[tuple]) -> None:
    for bucket, mine, work in pending:
        work.wait()
        _keep_rows(bucket, mine, shards.size)
    for shard in shards.sharded:
        shard.param.grad = None
        shard.param.data = shard.param.data.new_empty((0,))
    shards.gathered = False


class ShardsInFlight(BucketsInFlight):
    """reduce_and_release started from inside the stage's last W (or BW) of the step, as
    BucketsInFlight starts an all-reduce [Note: all-reduce in the last W in
    executors/torch/train/replicas.py]: the whole parameters' buckets all-reduce and the sharded
    ones' reduce-scatter as the op makes their gradients final, each kind in its bucket order
    (`reverse`: last first), so every replica starts the same collectives in the same order;
    `wait_and_release` then ends as reduce_and_release does, the same sums bit for bit."""

    def __init__(self, shards: StageShards, *, reverse: bool = False) -> None:
        self.shards, self.group = shards, shards.group
        self.whole = BucketsInFlight(shards.group, [p for _, p in shards.whole],
                                     reverse=reverse)
        self.buckets = _buckets(shards.sharded)
        self.order = self.buckets[::-1] if reverse else self.buckets
        self.final_ids: set[int] = set()
        self.pending: list[tuple] = []

    def mark_final(self, params: Any) -> None:
        params = list(params)
        self.whole.mark_final(params)
        super().mark_final(params)

    def wait_and_release(self) -> None:
        self._check_started()
        self.whole.wait()
        _keep_and_release(self.shards, self.pending)

    def discard(self) -> None:
        self.whole.discard()
        super().discard()

    def _params(self) -> list[torch.Tensor]:
        return self.whole._params() + super()._params()

    @staticmethod
    def _tensors(bucket: list) -> list[torch.Tensor]:
        return [shard.param for shard in bucket]

    def _start(self, bucket: list) -> None:
        self.pending.append(_reduce_scatter(self.shards, bucket))


def _buckets(sharded: list[ShardedParam]) -> list[list[ShardedParam]]:
    """Consecutive parameters of one dtype and device, up to BUCKET_BYTES a bucket."""
    buckets: list[list[ShardedParam]] = []
    size = 0
    for shard in sharded:
        nbytes = shard.param.numel() * shard.param.element_size()
        last = buckets[-1][-1].param if buckets else None
        if (last is None or size + nbytes > BUCKET_BYTES or last.dtype != shard.param.dtype
                or last.device != shard.param.device):
            buckets.append([shard])
            size = nbytes
        else:
            buckets[-1].append(shard)
            size += nbytes
    return buckets


def _reduce_scatter(shards: StageShards, bucket: list[ShardedParam]) -> tuple:
    """Start the bucket's reduce-scatter: rank r's part is every parameter's rows r, padded
    to the chunk's rows and flattened, so every part has one size."""
    size = shards.size
    parts = []
    for rank in range(size):
        rows = [_padded(_grad(s), s.shape, rank, size).reshape(-1) for s in bucket]
        parts.append(torch.cat(rows))
    mine = torch.empty_like(parts[0])
    return bucket, mine, shards.group.reduce_scatter([mine], [parts])


def _grad(shard: ShardedParam) -> torch.Tensor:
    """The parameter's gradient; zeros where it has none (a replica may have no microbatch
    that reaches it, and every rank takes part in the collective)."""
    if shard.param.grad is None:
        shard.param.grad = torch.zeros_like(shard.param)
    return shard.param.grad


def _padded(tensor: torch.Tensor, shape: tuple[int, ...], rank: int,
            size: int) -> torch.Tensor:
    """`rank`'s rows of `tensor`, with zero rows up to the chunk's ceil(rows / size)."""
    rows = shard_rows(tensor, rank, size)
    padded = tensor.new_zeros((math.ceil(shape[0] / size), *shape[1:]))
    padded[:rows.size(0)] = rows
    return padded


def _keep_rows(bucket: list[ShardedParam], mine: torch.Tensor, size: int) -> None:
    """Each parameter's summed rows, out of this rank's part of the bucket."""
    offset = 0
    for shard in bucket:
        chunk = math.ceil(shard.shape[0] / size)
        count = chunk * math.prod(shard.shape[1:])
        piece = mine[offset:offset + count].view(chunk, *shard.shape[1:])
        shard.rows.grad = piece[:shard.rows.size(0)].clone()
        offset += count


def sharded_squared_norm(shards: StageShards, local: float) -> float:
    """`local` (the whole parameters' squared norm, the same on every replica) plus the squared
    norm of the sharded gradients, summed over the group."""
    sums = [s.rows.grad.detach().double().pow(2).sum() for s in shards.sharded
            if s.rows.grad is not None]
    # on the rows' device: NCCL reduces CUDA tensors only
    device = shards.sharded[0].rows.device
    total = torch.stack(sums).sum().reshape(1) if sums else \
        torch.zeros(1, dtype=torch.float64, device=device)
    shards.group.allreduce([total]).wait()
    return float(local) + float(total.item())


def shards_of(shards: StageShards, optimizer: torch.optim.Optimizer | None) -> dict:
    """This replica's share, on the CPU: {"rank", "size", "params": {name: rows or whole},
    "optimizer": {name: {state name: rows or whole, "step": ...}}, "whole": [names]}, for
    `full_stage_state` to put together."""
    states = optimizer.state if optimizer is not None else {}
    params, optim = {}, {}
    for shard in shards.sharded:
        params[shard.name] = shard.rows.detach().cpu().clone()
        optim[shard.name] = _state_on_cpu(states.get(shard.rows, {}))
    for name, param in shards.whole:
        params[name] = param.detach().cpu().clone()
        optim[name] = _state_on_cpu(states.get(param, {}))
    return {"rank": shards.rank, "size": shards.size, "params": params, "optimizer": optim,
            "whole": [name for name, _ in shards.whole]}


def _state_on_cpu(state: dict) -> dict:
    return {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
            for k, v in state.items()}


def full_stage_state(shares: list[dict]) -> tuple[dict, dict]:
    """A stage's whole parameters and per-parameter AdamW states by name, from every
    replica's `shards_of`: the rows of a sharded tensor concatenated in rank order, a whole
    one taken from rank 0. The state a checkpoint can save without the replica count."""
    shares = sorted(shares, key=lambda s: s["rank"])
    if [s["rank"] for s in shares] != list(range(shares[0]["size"])):
        raise ValueError(f"full_stage_state needs every rank's share once, got ranks "
                         f"{[s['rank'] for s in shares]} of {shares[0]['size']}")
    whole = set(shares[0]["whole"])
    params, optim = {}, {}
    for name in shares[0]["params"]:
        if name in whole:
            params[name], optim[name] = shares[0]["params"][name], shares[0]["optimizer"][name]
            continue
        params[name] = torch.cat([s["params"][name] for s in shares])
        optim[name] = _joined([s["optimizer"][name] for s in shares])
    return params, optim


def _joined(states: list[dict]) -> dict:
    """Per-parameter optimizer states of the ranks' rows, joined: row tensors concatenated,
    a scalar (AdamW's step) taken from rank 0, where every rank counts alike."""
    out = {}
    for key, value in states[0].items():
        rowwise = isinstance(value, torch.Tensor) and value.dim() > 0
        out[key] = torch.cat([s[key] for s in states]) if rowwise else value
    return out
