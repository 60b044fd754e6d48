"""One stage per device: GPipe, 1F1B, and the Zero Bubble paper's handcrafted ZB-H1 and ZB-H2.

GPipe and 1F1B run the fused backward (BW). ZB-H1 and ZB-H2 split it into B and W and place the W
ops to fill bubbles; their order is fixed (it does not look at the costs), which is what lets the
paper's bubble formulas and Table 5 rates hold for them (see tests/planner/test_paper_table5.py).
"""

from __future__ import annotations

from collections.abc import Iterator

from flowkit.planner.ir import Action, Kind, Placement, Schedule
from flowkit.planner.schedules.registry import ScheduleRequest, register

__all__ = ["gpipe", "one_f_one_b", "zb_h1", "zb_h2"]


def _schedule(request: ScheduleRequest, device_ops: list[list[Action]]) -> Schedule:
    return Schedule(kind=request.kind, placement=Placement.one_per_device(request.devices),
                    microbatches=request.microbatches, device_ops=device_ops)


@register("gpipe")
def gpipe(request: ScheduleRequest) -> Schedule:
    """GPipe: every forward, then every fused backward; peak memory m."""
    m = request.microbatches

    def stage_ops(s: int) -> list[Action]:
        forwards = [Action(s, Kind.F, mb) for mb in range(m)]
        return forwards + [Action(s, Kind.BW, mb) for mb in range(m)]

    return _schedule(request, [stage_ops(s) for s in range(request.devices)])


def _one_f_one_b_ops(stage: int, stages: int, microbatches: int) -> Iterator[Action]:
    """Warm up with (stages - 1 - stage) forwards, then alternate F and BW, then drain."""
    warmup = min(stages - 1 - stage, microbatches)
    for mb in range(warmup):
        yield Action(stage, Kind.F, mb)
    for k in range(microbatches - warmup):
        yield Action(stage, Kind.F, warmup + k)
        yield Action(stage, Kind.BW, k)
    for k in range(microbatches - warmup, microbatches):
        yield Action(stage, Kind.BW, k)


@register("1f1b")
def one_f_one_b(request: ScheduleRequest) -> Schedule:
    """1F1B (PipeDream-flush): one forward, one fused backward; peak memory p."""
    p, m = request.devices, request.microbatches
    return _schedule(request, [list(_one_f_one_b_ops(s, p, m)) for s in range(p)])


# [Note: handcrafted zero-bubble orders] Both orders are fixed (they do not look at the costs)
# and take each kind's microbatches in order, so the paper's bubble formulas hold for them
# whenever W <= F and W <= B.
# ZB-H1 is 1F1B with the backward split: stage s defers the W's of its first s backwards, and the
# cooldown, where 1F1B idles waiting for gradients, runs them instead. A stage holds at most p
# microbatches from F to W, as in 1F1B.
# ZB-H2 doubles both: stage s warms up with 2(p-1-s)+1 forwards, enough to fill the time until its
# first gradient arrives, runs B, W, F in the steady state and defers its first 2s W's to the
# tail. That turns the trapezoid into a parallelogram with 2p-1 microbatches in flight.
# Counting a microbatch as in flight until its W matches the paper's memory, where B frees only
# part of the activations; the default MemoryModel peaks at p and 2p-1 as well.


def _split_backward_ops(stage: int, microbatches: int, *, warmup: int, defer: int,
                        steady: str) -> Iterator[Action]:
    """Warm-up forwards, a steady state with one F, B and (after `defer` B's) W per step, in the
    order `steady` ("FBW" or "BWF"), a cooldown of B's and W's, and the deferred W's at the end."""
    m = microbatches
    w_next = 0

    def backward(mb: int) -> Iterator[Action]:
        nonlocal w_next
        yield Action(stage, Kind.B, mb)
        if mb >= defer:
            yield Action(stage, Kind.W, w_next)
            w_next += 1

    for mb in range(warmup):
        yield Action(stage, Kind.F, mb)
    for k in range(m - warmup):
        forward = Action(stage, Kind.F, warmup + k)
        if steady == "FBW":
            yield forward
        yield from backward(k)
        if steady == "BWF":
            yield forward
    for k in range(m - warmup, m):
        yield from backward(k)
    for mb in range(w_next, m):
        yield Action(stage, Kind.W, mb)


@register("zb-h1")
def zb_h1(request: ScheduleRequest) -> Schedule:
    """ZB-H1: split backward, W fills 1F1B's tail; 1F1B's memory, bubble (p-1)(F+B-W)."""
    p, m = request.devices, request.microbatches
    return _schedule(
        request, [list(_split_backward_ops(s, m, warmup=min(p - 1 - s, m), defer=s, steady="FBW"))
                  for s in range(p)])


@register("zb-h2")
def zb_h2(request: ScheduleRequest) -> Schedule:
    """ZB-H2: extra warm-up forwards, W fills the tail; memory 2p-1, bubble (p-1)(F+B-2W)."""
    p, m = request.devices, request.microbatches
    return _schedule(
        request, [list(_split_backward_ops(s, m, warmup=min(2 * (p - 1 - s) + 1, m), defer=2 * s,
                                           steady="BWF"))
                  for s in range(p)])
