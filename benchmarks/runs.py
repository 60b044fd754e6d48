"""How a bench runs a flow: through the public run API, as `flowkit run` and a Python user do
(`flowkit.Run`), with no dashboard and no lines of its own (a bench prints its figures)."""

from __future__ import annotations

from typing import Any

__all__ = ["bench_run"]


def bench_run(flow: Any, *, controller: Any = None, **settings: Any) -> Any:
    """A `Run` of `flow` with `RunConfig(**settings)`, to enter; `controller`: run on its
    executors, already in, and leave them running (runs side by side on the same processes)."""
    from rich.console import Console

    from flowkit import Run, RunConfig

    return Run(flow, RunConfig(dashboard=False, **settings), controller=controller,
               console=Console(quiet=True))
