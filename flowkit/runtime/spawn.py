"""Child processes that die with their parent [Note: liveness in flowkit/wire/liveness.py].

On Linux each child asks the kernel, between fork and exec, for SIGKILL when its parent dies
(prctl PR_SET_PDEATHSIG): a controller killed with SIGKILL, or crashing, takes its local
executors with it instead of leaving them to wait for a connection that never comes back.

The "parent" of PR_SET_PDEATHSIG is the *thread* that forked: a child forked by a thread that
ends is killed then, its process alive. So every child is forked by one long-lived daemon
thread, whichever thread asks (a restart asks from the step loop, a library user from any
thread of theirs). Elsewhere than Linux the children are plain subprocesses.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["spawn"]

_PR_SET_PDEATHSIG = 1


def _parent_death_hook() -> Callable[[], None] | None:
    """The preexec_fn that arms the parent-death signal, or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up now: the child only calls it
    parent = os.getpid()

    def arm() -> None:
        if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            os._exit(126)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(126)

    return arm


class _Forker(threading.Thread):
    """The one thread that forks the children (why: the module's docstring)."""

    def __init__(self) -> None:
        super().__init__(name="flowkit-spawn", daemon=True)
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.hook = _parent_death_hook()
        self.owner = os.getpid()  # a forked copy of this process needs a thread of its own

    def run(self) -> None:
        while True:
            future, args, kwargs = self.requests.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(subprocess.Popen(*args, preexec_fn=self.hook, **kwargs))
                except BaseException as exc:  # the caller's to handle, never this thread's end
                    future.set_exception(exc)


_forker: _Forker | None = None
_forker_lock = threading.Lock()


def spawn(*args: Any, **kwargs: Any) -> subprocess.Popen:
    """subprocess.Popen(*args, **kwargs) for a child that dies with this process."""
    global _forker
    with _forker_lock:
        if _forker is None or not _forker.is_alive() or _forker.owner != os.getpid():
            _forker = _Forker()
            _forker.start()
        forker = _forker
    future: Future = Future()
    forker.requests.put((future, args, kwargs))
    return future.result()
