"""The runtime: controller, futures, wire protocol, local launchers. Imports no model code."""

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
from flowkit.runtime.launch import LocalExecutors
from flowkit.runtime.refs import Gather, Item

__all__ = [
    "ALL_COMPLETED",
    "FIRST_COMPLETED",
    "Controller",
    "ExecutorLost",
    "Future",
    "Gather",
    "Item",
    "LocalExecutors",
    "NoExecutor",
    "RemoteError",
    "TaskCancelled",
    "wait",
]
