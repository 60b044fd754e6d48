"""What model ops cost on the timed simulator executor, in seconds."""

from __future__ import annotations

import math
from typing import Any

import attrs

from flowkit.planner.ir import Costs

__all__ = ["SimCosts"]


def _seconds(_instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"sim cost {attribute.name} must be a finite number of seconds >= 0, "
                         f"got {value!r}")


def _count(value: Any) -> Any:
    """A spec's values are parsed as floats: 64.0 is the count 64; 6.5 stays for the check."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _counted(_instance: object, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"sim cost {attribute.name} must be a whole number >= 1, got {value!r}")


def _bytes(_instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"sim cost {attribute.name} must be a finite number of bytes >= 0, "
                         f"got {value!r}")


def _positive(_instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"sim cost {attribute.name} must be a finite number > 0, got {value!r}")


_COUNTS = ("token_budget", "max_batch")


@attrs.frozen(kw_only=True)
class SimCosts:
    """Defaults are a small GPT on one GPU: a few ms per pipeline op and per optimizer step.

    Generation runs on a rollout engine (executors/sim/engine.py): one decode iteration advances
    every live sequence of the executor by one token and costs `token + token_per_seq * b` for
    b live sequences. Decoding is memory-bound, so the weights' read (`token`) dominates: a
    lone sequence's iteration costs 0.5 ms, one of 256 sequences about twice that. `token`
    keeps its old meaning (one decode step of a prompt's n samples, decoded together), so a
    64-token response still takes ~32 ms when its prompt decodes alone."""

    F: float = attrs.field(default=0.002, converter=float, validator=_seconds)
    B: float = attrs.field(default=0.002, converter=float, validator=_seconds)
    W: float = attrs.field(default=0.001, converter=float, validator=_seconds)
    optimizer_step: float = attrs.field(default=0.002, converter=float, validator=_seconds)
    # F, B and W per token of the microbatch, on top of the above (0: a microbatch costs the
    # same whatever its tokens) [Note: per-token costs in executors/sim/ops.py]
    F_token: float = attrs.field(default=0.0, converter=float, validator=_seconds)
    B_token: float = attrs.field(default=0.0, converter=float, validator=_seconds)
    W_token: float = attrs.field(default=0.0, converter=float, validator=_seconds)
    # a decode iteration: fixed (weights read once per iteration) + per live sequence (its KV)
    token: float = attrs.field(default=0.0005, converter=float, validator=_seconds)
    token_per_seq: float = attrs.field(default=0.000002, converter=float, validator=_seconds)
    # prefill is compute-bound: ~200 prompt tokens cost what one decode iteration does
    prefill_token: float = attrs.field(default=0.0000025, converter=float, validator=_seconds)
    # tokens one iteration may process: decodes first, chunks of new prompts' prefill the rest
    token_budget: int = attrs.field(default=2048, converter=_count, validator=_counted)
    max_batch: int = attrs.field(default=256, converter=_count, validator=_counted)
    infer_token: float = attrs.field(default=0.00002, converter=float, validator=_seconds)
    activation_bytes: int = attrs.field(default=1 << 16, converter=int)
    # one offload or prefetch copy of a microbatch's stashed activations, one way, on a copy
    # engine beside compute [Note: offload in flowkit/planner/offload.py]
    copy: float = attrs.field(default=0.0, converter=float, validator=_seconds)
    # response lengths: exponential (0), or log-normal with this sigma (a longer tail)
    length_sigma: float = attrs.field(default=0.0, converter=float, validator=_seconds)
    # how much prompts differ: each prompt's lengths are scaled by a log-normal factor with
    # this sigma, seeded by its prompt_id, so a prompt that ran long runs long again (what a
    # length predictor learns from); 0: every prompt alike
    prompt_sigma: float = attrs.field(default=0.0, converter=float, validator=_seconds)
    # data parallel: the gradients' bytes of the whole model (each of P pipeline devices holds
    # 1/P of them), summed over D replicas by a ring all-reduce at `allreduce_gbps` gigabits a
    # second with `allreduce_latency` seconds on top (allreduce_s)
    grad_bytes: float = attrs.field(default=0.0, converter=float, validator=_bytes)
    allreduce_gbps: float = attrs.field(default=100.0, converter=float, validator=_positive)
    allreduce_latency: float = attrs.field(default=2e-5, converter=float, validator=_seconds)

    @classmethod
    def parse(cls, text: str) -> SimCosts:
        """'F=0.002,token=0.001,max_batch=64': any of the fields, the rest default."""
        values: dict[str, Any] = {}
        names = {f.name.lower(): f.name for f in attrs.fields(cls)}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, eq, value = part.partition("=")
            name = names.get(key.strip().lower())
            if not eq or name is None:
                raise ValueError(f"sim cost {part!r}: expected NAME=SECONDS (or NAME=COUNT for "
                                 f"{' and '.join(_COUNTS)}) with NAME one of "
                                 f"{', '.join(names.values())}")
            try:
                values[name] = float(value)
            except ValueError:
                raise ValueError(f"sim cost {part!r}: {value!r} is not a number") from None
        return cls(**values)

    def allreduce_s(self, replicas: int, devices: int) -> float:
        """Seconds to sum one pipeline device's share of the gradients over `replicas` with a
        ring all-reduce: each replica sends and receives 2(D-1)/D of the bytes (a
        reduce-scatter, then an all-gather), plus the latency; 0 for one replica."""
        if replicas <= 1:
            return 0.0
        share = self.grad_bytes / max(1, devices)
        wire = 2 * (replicas - 1) / replicas * share * 8 / (self.allreduce_gbps * 1e9)
        return wire + self.allreduce_latency

    def per_token(self, kind: str) -> float:
        """Seconds per token of a pipeline op of `kind` (F, B, W, or BW: B and W)."""
        return {"F": self.F_token, "B": self.B_token, "W": self.W_token,
                "BW": self.B_token + self.W_token}.get(kind, 0.0)

    def stage_costs(self, stages: int) -> Costs:
        return Costs.uniform(stages, F=self.F, B=self.B, W=self.W, copy=self.copy)

    def iteration_s(self, batch: int) -> float:
        """One decode iteration of `batch` live sequences, without prefill: t(b)."""
        return self.token + self.token_per_seq * batch

    def config_for(self, op: str) -> dict:
        """The cost keys the simulator's op `op` reads."""
        if op == "generate":
            return {"seconds_per_token": self.token, "seconds_per_seq": self.token_per_seq,
                    "seconds_per_prefill_token": self.prefill_token,
                    "token_budget": self.token_budget, "max_batch": self.max_batch,
                    "length_sigma": self.length_sigma, "prompt_sigma": self.prompt_sigma}
        if op in ("logprobs", "values", "reward_model"):
            return {"seconds_per_token": self.infer_token}
        if op == "optimizer_step":
            return {"seconds": self.optimizer_step}
        return {}
