"""The action IR of pipeline schedules: actions, placements, costs, memory model, schedules.

Schedules are data, as in DeepSpeed's pipeline schedules: a schedule is a placement plus one
ordered tuple of actions per device, and everything here is immutable, hashable and free of
torch/zmq so that it can be built, printed, parsed, simulated and tested anywhere.
"""

from __future__ import annotations

import enum
import functools
import math
import re
from collections.abc import Iterable, Sequence

import attrs

from flowkit.planner.dims import layer_flops, layer_memory

__all__ = ["Action", "ActionKey", "Costs", "Kind", "MemoryModel", "Placement", "Schedule",
           "action_key", "bubble_rate"]


class Kind(str, enum.Enum):
    """What an action computes for one (stage, microbatch)."""

    F = "F"  # forward
    B = "B"  # backward for the inputs only; stashes what W needs
    W = "W"  # backward for the weights, from what B stashed
    BW = "BW"  # B and W fused into one full backward
    # copies on the device's copy engines, never its compute [Note: offload]
    O = "O"  # noqa: E741 - offload: F's stashed activations to host memory
    P = "P"  # prefetch: them back to the device, before the B (or BW)

    def __str__(self) -> str:
        return self.value

    @property
    def is_copy(self) -> bool:
        return self is Kind.O or self is Kind.P


ActionKey = tuple[int, str, int]


def action_key(stage: int, kind: Kind | None, microbatch: int) -> ActionKey:
    """What the actions that depend on this one wait for.

    [Note: B and BW share a key] A stage's backward is made by B or by BW, whichever its schedule
    uses, and its dependents read either alike: both map to "B", and so does a dependency's kind
    None ("B or BW")."""
    backward = kind is None or kind is Kind.B or kind is Kind.BW
    return (stage, "B" if backward else kind.value, microbatch)


_ACTION_TEXT = re.compile(r"^\s*(\d+)(BW|F|B|W|O|P)(\d+)\s*$")


@attrs.frozen(order=True)
class Action:
    """One op of a schedule; prints and parses as ``{stage}{kind}{microbatch}`` (``2F0``,
    ``3BW7``)."""

    stage: int = attrs.field(validator=attrs.validators.ge(0))
    kind: Kind = attrs.field(converter=Kind)
    microbatch: int = attrs.field(validator=attrs.validators.ge(0))

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @property
    def key(self) -> ActionKey:
        """What its dependents wait for [Note: B and BW share a key]."""
        return action_key(self.stage, self.kind, self.microbatch)

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION_TEXT.match(text)
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected {{stage}}{{kind}}{{microbatch}} "
                "with kind one of F, B, W, BW, O, P, e.g. '2F0' or '3BW7'")
        stage, kind, microbatch = match.groups()
        return cls(int(stage), Kind(kind), int(microbatch))


def bubble_rate(spans: Sequence[float], busy: Sequence[float]) -> float:
    """The Zero Bubble paper's bubble rate: (max span - max busy) / max span, a device's span
    running from its first op's start to its last op's end and the busiest device's op time
    the ideal. The planner's simulator, the runtime's measurement and the dashboard use it."""
    max_span = max(spans, default=0.0)
    # float sums can leave the busiest device a hair over the longest span; never negative
    return max(0.0, (max_span - max(busy)) / max_span) if max_span > 0 else 0.0


def _as_int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


@attrs.frozen
class Placement:
    """Which device holds each pipeline stage (a stage is a contiguous slice of the model)."""

    stage_to_device: tuple[int, ...] = attrs.field(converter=_as_int_tuple)

    def __attrs_post_init__(self) -> None:
        if not self.stage_to_device:
            raise ValueError("a placement needs at least one stage")
        devices = set(self.stage_to_device)
        if devices != set(range(len(devices))):
            raise ValueError(f"devices must be numbered 0..n-1 with every device holding a stage, "
                             f"got stage_to_device={list(self.stage_to_device)}")

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_device)

    # cached: the schedule searches ask these in their inner loops (a placement is frozen)
    @functools.cached_property
    def num_devices(self) -> int:
        return max(self.stage_to_device) + 1

    @functools.cached_property
    def chunks(self) -> int:
        """Stages per device (1 for plain pipelines, v for interleaved, 2 for V shapes)."""
        return self.num_stages // self.num_devices

    def device_of(self, stage: int) -> int:
        return self.stage_to_device[stage]

    def stages_on(self, device: int) -> tuple[int, ...]:
        return tuple(s for s, d in enumerate(self.stage_to_device) if d == device)

    @classmethod
    def one_per_device(cls, devices: int) -> Placement:
        return cls(range(devices))

    @classmethod
    def interleaved(cls, devices: int, chunks: int) -> Placement:
        """Megatron's virtual pipeline: stage s lives on device s mod p."""
        return cls(s % devices for s in range(devices * chunks))

    @classmethod
    def vshape(cls, devices: int) -> Placement:
        """Device d holds stages d and 2p-1-d, so the first and last stage share device 0."""
        return cls(s if s < devices else 2 * devices - 1 - s for s in range(2 * devices))


def _as_float_tuple(values: Iterable[float]) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


def _nonnegative(_instance: object, attribute: attrs.Attribute, value: Sequence[float]) -> None:
    if any(not math.isfinite(v) or v < 0 for v in value):
        raise ValueError(
            f"costs must be finite and non-negative, got {attribute.name}={list(value)}")


def _finite(_instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be a finite number, got {value!r}")


@attrs.frozen(kw_only=True)
class Costs:
    """Time of F, B and W for each stage, and of moving one activation between devices."""

    F: tuple[float, ...] = attrs.field(converter=_as_float_tuple, validator=_nonnegative)
    B: tuple[float, ...] = attrs.field(converter=_as_float_tuple, validator=_nonnegative)
    W: tuple[float, ...] = attrs.field(converter=_as_float_tuple, validator=_nonnegative)
    comm: float = attrs.field(default=0.0, converter=float,
                              validator=[_finite, attrs.validators.ge(0.0)])
    # Time every op takes beyond its own cost (an executor's dispatch), as profiled on real
    # processes; the simulator adds it to each op, a fused BW included once.
    per_op: float = attrs.field(default=0.0, converter=float,
                                validator=[_finite, attrs.validators.ge(0.0)])
    # Time of one offload or prefetch copy of a microbatch's stash per stage (empty: copies
    # take no time): bytes over the host link's bandwidth [Note: offload].
    copy: tuple[float, ...] = attrs.field(default=(), converter=_as_float_tuple,
                                          validator=_nonnegative)

    def __attrs_post_init__(self) -> None:
        if not (len(self.F) == len(self.B) == len(self.W)) or not self.F:
            raise ValueError(
                f"F, B and W need one cost per stage each, got {len(self.F)}, {len(self.B)}, "
                f"{len(self.W)}")
        if self.copy and len(self.copy) != len(self.F):
            raise ValueError(f"copy needs one cost per stage or none, got {len(self.copy)} for "
                             f"{len(self.F)} stages")

    @property
    def num_stages(self) -> int:
        return len(self.F)

    @classmethod
    def uniform(cls, stages: int, *, F: float = 1.0, B: float = 1.0, W: float = 1.0,
                comm: float = 0.0, copy: float | None = None) -> Costs:
        return cls(F=[F] * stages, B=[B] * stages, W=[W] * stages, comm=comm,
                   copy=[copy] * stages if copy is not None else ())

    @classmethod
    def from_dims(cls, *, layers_per_stage: Sequence[int], seq: int, micro_batch: int, hidden: int,
                  flops_per_s: float = 1.0, comm: float = 0.0, heads: int | None = None,
                  host_bytes_per_s: float | None = None,
                  attention_scores: bool = True) -> Costs:
        """Costs from the paper's Table 1 FLOPs (`flowkit.planner.dims`), one entry per stage
        of `layers_per_stage` layers (the last may carry more: the LM head). `flops_per_s` turns
        FLOPs into time; the default 1 leaves them in FLOPs, which is enough without `comm`.
        With `heads` and `host_bytes_per_s` (a host link's bandwidth, same time unit), `copy`
        is a stage's activation bytes (Table 1's M_B per layer; without the attention
        scores where `attention_scores` is False, as a flash attention stores) over that
        bandwidth."""
        if not math.isfinite(flops_per_s) or flops_per_s <= 0:
            raise ValueError(f"flops_per_s must be a positive number, got {flops_per_s!r}")
        f, b, w = layer_flops(seq=seq, micro_batch=micro_batch, hidden=hidden)
        times = [n / flops_per_s for n in layers_per_stage]
        copy: list[float] = []
        if host_bytes_per_s is not None:
            if heads is None or not math.isfinite(host_bytes_per_s) or host_bytes_per_s <= 0:
                raise ValueError("copy times need heads and a positive host_bytes_per_s, got "
                                 f"heads={heads!r}, host_bytes_per_s={host_bytes_per_s!r}")
            m_b, _ = layer_memory(seq=seq, micro_batch=micro_batch, hidden=hidden, heads=heads,
                                  attention_scores=attention_scores)
            copy = [n * m_b / host_bytes_per_s for n in layers_per_stage]
        return cls(F=[f * t for t in times], B=[b * t for t in times], W=[w * t for t in times],
                   comm=comm, copy=copy)

    def of(self, action: Action) -> float:
        if action.kind.is_copy:  # the copy engine's time; no executor dispatch [Note: offload]
            return self.copy_of(action.stage)
        return self.per_op + self._work(action)

    def copy_of(self, stage: int) -> float:
        """Time to move one microbatch's stashed activations of `stage` between device and host
        memory, one way (0 where `copy` is not given)."""
        return self.copy[stage] if self.copy else 0.0

    def _work(self, action: Action) -> float:
        s = action.stage
        if action.kind is Kind.F:
            return self.F[s]
        if action.kind is Kind.B:
            return self.B[s]
        if action.kind is Kind.W:
            return self.W[s]
        return self.B[s] + self.W[s]

    def for_placement(self, placement: Placement) -> Costs:
        """Map per-device-share costs onto the stages of `placement` (each stage gets 1/chunks)."""
        if self.num_stages != placement.num_devices:
            raise ValueError(
                f"costs are given for {self.num_stages} device shares but the placement has "
                f"{placement.num_devices} devices")
        v = placement.chunks
        d = placement.stage_to_device
        stages = range(placement.num_stages)
        return Costs(F=[self.F[d[s]] / v for s in stages],
                     B=[self.B[d[s]] / v for s in stages],
                     W=[self.W[d[s]] / v for s in stages],
                     comm=self.comm, per_op=self.per_op,
                     copy=[self.copy[d[s]] / v for s in stages] if self.copy else ())

    def to_json(self) -> dict:
        out = {"F": list(self.F), "B": list(self.B), "W": list(self.W), "comm": self.comm}
        if self.per_op:
            out["per_op"] = self.per_op
        if self.copy:
            out["copy"] = list(self.copy)
        return out


@attrs.frozen(kw_only=True)
class MemoryModel:
    """Activation memory each op adds (+) or frees (-), in units of one microbatch's activations
    of one device's share (1/P) of the model. A stage that is 1/v of a share scales these by 1/v."""

    F: float = attrs.field(default=1.0, validator=_finite)
    B: float = attrs.field(default=-0.5, validator=_finite)
    W: float = attrs.field(default=-0.5, validator=_finite)
    BW: float = attrs.field(default=-1.0, validator=_finite)

    @classmethod
    def from_dims(cls, *, seq: int, micro_batch: int, hidden: int, heads: int) -> MemoryModel:
        """The paper's Table 1 split (`flowkit.planner.dims`): F adds one unit (M_B), B frees
        all but the M_W that W still needs, W frees that, BW frees the whole unit. The model's
        size and layer count cancel out: units are one microbatch of one device share."""
        m_b, m_w = layer_memory(seq=seq, micro_batch=micro_batch, hidden=hidden, heads=heads)
        kept = m_w / m_b
        return cls(F=1.0, B=-(1.0 - kept), W=-kept, BW=-1.0)

    def delta(self, action: Action, chunks: int = 1) -> float:
        """What the op adds when it runs; a copy's effect depends on its timing, so it is 0
        here and `offloaded` says what it moves [Note: offload]."""
        if action.kind.is_copy:
            return 0.0
        return getattr(self, action.kind.value) / chunks

    def offloaded(self, chunks: int = 1) -> float:
        """What an offload takes off the device until its prefetch starts: all that the F
        added (B, W and BW free it later, on the device)."""
        return max(0.0, self.F) / chunks

    def to_json(self) -> dict:
        return {"F": self.F, "B": self.B, "W": self.W, "BW": self.BW}


def _as_device_ops(ops: Iterable[Iterable[Action]]) -> tuple[tuple[Action, ...], ...]:
    return tuple(tuple(device) for device in ops)


@attrs.frozen(kw_only=True)
class Schedule:
    """A placement plus the ordered actions each device runs."""

    kind: str
    placement: Placement
    microbatches: int
    device_ops: tuple[tuple[Action, ...], ...] = attrs.field(converter=_as_device_ops)

    def __attrs_post_init__(self) -> None:
        if len(self.device_ops) != self.placement.num_devices:
            raise ValueError(f"schedule {self.kind!r} has {len(self.device_ops)} device lists for "
                             f"{self.placement.num_devices} devices")

    @property
    def num_devices(self) -> int:
        return self.placement.num_devices

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    def text(self) -> list[list[str]]:
        return [[str(a) for a in ops] for ops in self.device_ops]
