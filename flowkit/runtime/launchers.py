"""Launchers by name, for a run to pick one (`flowkit run --launcher NAME`): `local`, executor
subprocesses on this machine (the default), or `ray`, Ray actors in a placement group
(raylaunch.py, which needs the `ray` extra)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flowkit.runtime.controller import Controller
from flowkit.runtime.launch import Launcher, LocalExecutors

__all__ = ["LAUNCHERS", "make_launcher"]

LAUNCHERS = ("local", "ray")


def make_launcher(name: str, controller: Controller, count: int, *, kind: str,
                  tags: Sequence[Sequence[str]], device: str = "cpu", code: Sequence[str] = (),
                  settings: Any = None, threads: int = 1) -> Launcher:
    """The launcher `name` of `count` executors of `kind` for `controller`, executor i with
    `tags[i]` and `threads` compute threads; `settings` are the launcher's own
    (raylaunch.RaySettings for `ray`)."""
    common = {"kind": kind, "tags": tags, "device": device, "code": code, "threads": threads}
    if name == "local":
        if settings is not None:
            raise ValueError(f"the local launcher takes no settings, not {settings!r}")
        return LocalExecutors(controller, count, **common)
    if name == "ray":
        from flowkit.runtime.raylaunch import RayExecutors, RaySettings

        return RayExecutors(controller, count, settings=settings or RaySettings(), **common)
    raise ValueError(f"no launcher {name!r}: choose one of {', '.join(LAUNCHERS)}")
