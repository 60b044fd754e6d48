"""The runtime: it runs lowered flows and dispatches their tasks. Imports no model code.

- flowrun.py: a flow's steps, node by node as the lowering says (stepstate.py: the step's items);
  flowtrain.py: a trained model's pipeline, optimizer step, weight sync (training.py: what each
  of those tasks is told); pipeline.py: a pipeline schedule as tasks.
- controller.py: submits tasks as futures and drives the sockets; dispatch.py: where each task
  goes and what becomes of its objects; futures.py, refs.py.
- protocol.py, serialize.py, shm.py: the wire; auth.py: keys and CurveZMQ on every socket
  beyond loopback; launch.py: launchers and local executor processes, raylaunch.py: Ray actors,
  launchers.py: launchers by name.
"""

from flowkit.runtime.controller import Controller, NoExecutor
from flowkit.runtime.futures import (
    ALL_COMPLETED,
    FIRST_COMPLETED,
    ExecutorLost,
    Future,
    RemoteError,
    TaskCancelled,
    wait,
)
from flowkit.runtime.launch import Launcher, LaunchError, LocalExecutors
from flowkit.runtime.launchers import LAUNCHERS, make_launcher
from flowkit.runtime.raylaunch import RayExecutors, RaySettings
from flowkit.runtime.refs import Gather, Item

__all__ = [
    "ALL_COMPLETED",
    "FIRST_COMPLETED",
    "Controller",
    "ExecutorLost",
    "Future",
    "Gather",
    "Item",
    "LAUNCHERS",
    "LaunchError",
    "Launcher",
    "LocalExecutors",
    "NoExecutor",
    "RayExecutors",
    "RaySettings",
    "RemoteError",
    "TaskCancelled",
    "make_launcher",
    "wait",
]
