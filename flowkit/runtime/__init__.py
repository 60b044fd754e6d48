"""The runtime: one controller that submits tasks as futures to executors and drives the sockets.
Imports no model code and knows no flow.

- controller.py: submits tasks as futures and drives the sockets; dispatch.py: where each task
  goes and what becomes of its objects; futures.py; registry.py: what the controller knows of
  executors, tasks and objects.
- launch.py: launchers and local executor processes, raylaunch.py: Ray actors, launchers.py:
  launchers by name; netns.py: separate hosts on one machine (network namespaces).
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
from flowkit.wire.refs import Gather, Item

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
