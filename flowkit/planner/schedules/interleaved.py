"""Interleaved 1F1B (Megatron-LM's virtual pipeline): v chunks per device, stage s on device s mod
p.

Microbatches go through in rounds. Within a round a device runs the round's forwards for chunk 0,
then chunk 1, ...; backwards take the chunks in reverse. Megatron needs m to be a multiple of p;
like PyTorch's ScheduleInterleaved1F1B we relax that by making rounds of at least p microbatches
(sizes differing by at most one), which keeps every chunk's forward ahead of its use downstream.
"""

from __future__ import annotations

from flowkit.planner.ir import Action, Kind, Placement, Schedule
from flowkit.planner.schedules.registry import ScheduleRequest, register

__all__ = ["interleaved_1f1b"]


def _rounds(microbatches: int, devices: int) -> list[range]:
    count = max(1, microbatches // devices)
    base, extra = divmod(microbatches, count)
    out, start = [], 0
    for r in range(count):
        size = base + (1 if r < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def _order(rounds: list[range], chunks: int, *, reverse: bool) -> list[tuple[int, int]]:
    """(chunk, microbatch) in the order a device visits them."""
    order = []
    for mbs in rounds:
        chunk_order = range(chunks - 1, -1, -1) if reverse else range(chunks)
        for chunk in chunk_order:
            order.extend((chunk, mb) for mb in mbs)
    return order


def _device_ops(device: int, p: int, m: int, v: int) -> list[Action]:
    rounds = _rounds(m, p)
    forwards = _order(rounds, v, reverse=False)
    backwards = _order(rounds, v, reverse=True)
    # Megatron's warm-up: fill all chunks but the last for the first round, plus 2 per
    # downstream device so that the first backward finds its gradient ready. With one chunk
    # there is no chunk switch to cover, and it is 1F1B's one per downstream device (as in
    # Megatron's non-interleaved schedule); 2 would double 1F1B's peak memory for nothing.
    downstream = p - 1 - device
    warmup = min((v - 1) * len(rounds[0]) + (2 if v > 1 else 1) * downstream, m * v)
    ops = [Action(c * p + device, Kind.F, mb) for c, mb in forwards[:warmup]]
    for i in range(m * v - warmup):
        c, mb = forwards[warmup + i]
        ops.append(Action(c * p + device, Kind.F, mb))
        c, mb = backwards[i]
        ops.append(Action(c * p + device, Kind.BW, mb))
    for c, mb in backwards[m * v - warmup :]:
        ops.append(Action(c * p + device, Kind.BW, mb))
    return ops


@register("interleaved-1f1b", chunks=None, default_chunks=2)
def interleaved_1f1b(request: ScheduleRequest) -> Schedule:
    """Interleaved 1F1B: v model chunks per device (default 2), fused backward."""
    p, m, v = request.devices, request.microbatches, request.chunks
    return Schedule(kind=request.kind, placement=Placement.interleaved(p, v), microbatches=m,
                    device_ops=[_device_ops(d, p, m, v) for d in range(p)])
