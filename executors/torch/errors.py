"""`StageError`: what the torch executor's ops raise when a task does not fit what this executor
holds; every part of the executor (stages, models, weights, generation) raises it."""

from __future__ import annotations

__all__ = ["StageError"]


class StageError(RuntimeError):
    """An op that does not fit the microbatch's state (B before F, W before B, F twice ...)."""
