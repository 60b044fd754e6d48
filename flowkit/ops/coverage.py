"""What of a lowered flow executors implementing a set of executor ops cannot run: the check a
runner makes before it starts executors of a kind, without naming any op or loss itself."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flowkit.ops.executor_ops import LOWERED_OPS
from flowkit.ops.losses import LOSSES

__all__ = ["unimplemented"]


def needed_ops(plan: Iterable[Any]) -> set[str]:
    """The executor ops the model ops of lowered `plan` (planner NodePlans) run as."""
    return {need for node in plan if node.model is not None
            for need in LOWERED_OPS.get(node.call.value, (node.op,))}


def unimplemented(plan: Iterable[Any], implemented: Iterable[str]) -> list[str]:
    """What of `plan` an executor with the ops `implemented` (and every loss in LOSSES) cannot
    run: the missing executor ops, then the unknown losses of its backprops; [] when it can."""
    plan = list(plan)
    missing = sorted(needed_ops(plan) - set(implemented))
    missing += sorted({f"the {node.config.get('loss')!r} loss" for node in plan
                       if node.call.value == "pipeline"
                       and node.config.get("loss", "lm") not in LOSSES})
    return missing
