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


@attrs.frozen(kw_only=True)
class SimCosts:
    """Defaults are a small GPT on one GPU: a few ms per pipeline op and per optimizer step, and
    a decode step of half a millisecond, so a 64-token response takes ~32 ms to generate."""

    F: float = attrs.field(default=0.002, converter=float, validator=_seconds)
    B: float = attrs.field(default=0.002, converter=float, validator=_seconds)
    W: float = attrs.field(default=0.001, converter=float, validator=_seconds)
    optimizer_step: float = attrs.field(default=0.002, converter=float, validator=_seconds)
    token: float = attrs.field(default=0.0005, converter=float, validator=_seconds)
    infer_token: float = attrs.field(default=0.00002, converter=float, validator=_seconds)
    activation_bytes: int = attrs.field(default=1 << 16, converter=int)
    # response lengths: exponential (0), or log-normal with this sigma (a longer tail)
    length_sigma: float = attrs.field(default=0.0, converter=float, validator=_seconds)

    @classmethod
    def parse(cls, text: str) -> SimCosts:
        """'F=0.002,token=0.001': any of the fields, the rest default."""
        values: dict[str, Any] = {}
        names = {f.name.lower(): f.name for f in attrs.fields(cls)}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, eq, value = part.partition("=")
            name = names.get(key.strip().lower())
            if not eq or name is None:
                raise ValueError(f"sim cost {part!r}: expected NAME=SECONDS with NAME one of "
                                 f"{', '.join(names.values())}")
            try:
                values[name] = float(value)
            except ValueError:
                raise ValueError(f"sim cost {part!r}: {value!r} is not a number") from None
        return cls(**values)

    def stage_costs(self, stages: int) -> Costs:
        return Costs.uniform(stages, F=self.F, B=self.B, W=self.W)

    def config_for(self, op: str) -> dict:
        """The cost keys the simulator's op `op` reads."""
        if op == "generate":
            return {"seconds_per_token": self.token, "length_sigma": self.length_sigma}
        if op in ("logprobs", "values", "reward_model"):
            return {"seconds_per_token": self.infer_token}
        if op == "optimizer_step":
            return {"seconds": self.optimizer_step}
        return {}
