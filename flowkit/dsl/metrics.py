"""`Metrics`: what an op reports about a step, for the dashboard and the metrics file."""

from __future__ import annotations

import attrs

__all__ = ["Metrics"]


@attrs.frozen
class Metrics:
    """Named numbers about a step (`reward_mean`, `response_length_mean`, ...). An op whose
    output items are Metrics is a reporter: `flowkit run` fetches its items after each step and
    adds their values to the step's metrics, as they are (later items win on a shared name).
    `warnings` are things the user should act on (responses cut by the model's context, ...):
    `flowkit run` prints each one once."""

    values: dict[str, float] = attrs.field(factory=dict)
    warnings: tuple[str, ...] = attrs.field(default=(), converter=tuple)
