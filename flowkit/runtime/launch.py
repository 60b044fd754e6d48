"""Launchers start executors. Local executors, subprocesses on this machine, are the embedded
default; netns.py starts them on namespace hosts, raylaunch.py as Ray actors. They share one
shape (`Launcher`), so a run and its restarts pick one by name (launchers.py) and treat them
alike."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from flowkit.runtime.controller import Controller
from flowkit.runtime.devices import local_devices
from flowkit.runtime.forkserver import ForkedProcess, start_executor
from flowkit.runtime.registry import ExecutorInfo
from flowkit.runtime.spawn import spawn

__all__ = ["ExecutorExited", "LaunchError", "Launcher", "LocalExecutors", "ProcessExecutors",
           "per_executor_tags", "preload_for", "stop_processes", "thread_env"]

# What a kind's fork server imports before it forks [Note: fork server in executors/forkserver.py]:
# the kind, the modules its op table registers, and what flow code imports (the DSL, networkx for
# its checks, dataflows' flows), which every executor imported again after its fork: 0.4 s of a
# core each (`python -X importtime`, networkx 0.26 s of it)
_FLOW_CODE = ("flowkit.dsl", "networkx", "dataflows.grpo", "dataflows.pretrain",
              "dataflows.datasets")
_PRELOAD = {
    "torch": ("executors.torch", "executors.torch.train.pipeline_ops",
              "executors.torch.rollout.generate", "executors.torch.rollout.infer",
              "executors.torch.state", *_FLOW_CODE),
    "sim": ("executors.sim", *_FLOW_CODE),
}


def preload_for(kind: str) -> tuple[str, ...]:
    """The modules a fork server for executors of `kind` imports before it forks."""
    return _PRELOAD.get(kind, ())

# how often a launcher waiting for its executors to connect looks at their processes
_WATCH_S = 0.05


class LaunchError(RuntimeError):
    """A launcher could not start its executors; the text says what was asked and why not."""


class ExecutorExited(LaunchError):
    """An executor's process exited while the launcher waited for its executors to connect:
    `name` exited with `code` while `doing` (starting, say)."""

    def __init__(self, name: str, code: int, doing: str) -> None:
        super().__init__(f"{name} exited with code {code} while {doing}")
        self.name, self.code, self.doing = name, code, doing


class Launcher(Protocol):
    """What starts a run's executors: `with launcher as executors:`, or start() ... stop().

    `start` returns the executors once all are connected; `replace(names)` starts a new one for
    each lost executor of `names`, with its name, tags and device, and returns every connected
    executor once they are in (a restart [Note: executor restarts] in
    flowkit/runner/checkpoints/restarts.py);
    `stop`, after the controller's shutdown, leaves no process and no shared-memory segment."""

    controller: Controller

    def start(self) -> list[ExecutorInfo]: ...

    def replace(self, names: Sequence[str]) -> list[ExecutorInfo]: ...

    def stop(self, timeout: float = 5.0) -> None: ...

    def __enter__(self) -> list[ExecutorInfo]: ...

    def __exit__(self, *exc: Any) -> None: ...


class ProcessExecutors:
    """A launcher of executor processes that this process starts itself, `count` of them named
    `{name_prefix}-{i}`; subclasses say which command starts executor i (`_command`).

    Each gets `threads` compute threads (1: several share the cores), dies with this process,
    and is
    watched, so its exit is noticed at once rather than at the heartbeat timeout: while they
    start too, when it fails `start` or `replace` with an ExecutorExited naming it."""

    def __init__(self, controller: Controller, count: int, *, name_prefix: str = "exec",
                 startup_timeout: float = 60.0, threads: int = 1) -> None:
        self.controller, self.count, self.name_prefix = controller, count, name_prefix
        self.startup_timeout, self.threads = startup_timeout, threads
        self.processes: list[subprocess.Popen] = []
        self.by_name: dict[str, subprocess.Popen] = {}  # the newest process of each executor

    def _command(self, i: int) -> list[str]:
        raise NotImplementedError

    def __enter__(self) -> list[ExecutorInfo]:
        try:
            return self.start()
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: Any) -> None:
        # the processes exit when their controller says so: shut it down first, or stop()
        # waits out its timeout on every one (shutdown is idempotent, `with Controller()` too)
        self.controller.shutdown()
        self.stop()

    def start(self) -> list[ExecutorInfo]:
        """Start them all; the executors once connected, in the order of their index. First,
        the shared-memory segments of dead processes (executors killed with their controller)
        go."""
        from flowkit.wire.shm import sweep_stale

        sweep_stale()
        for i in range(self.count):
            self._spawn(i)
        joined = self._await_all(lambda name: "starting")
        order = {f"{self.name_prefix}-{i}": i for i in range(self.count)}
        return sorted(joined, key=lambda e: order.get(e.name, len(order)))

    def replace(self, names: Sequence[str]) -> list[ExecutorInfo]:
        """A new process for each lost executor of `names`, with its name, tags and device (a
        restart: the run reloads their state from a checkpoint); every connected executor
        once they are in."""
        known = {f"{self.name_prefix}-{i}": i for i in range(self.count)}
        unknown = sorted(set(names) - set(known))
        if unknown:
            raise ValueError(f"{unknown} are not executors this launcher started")
        for name in names:  # a replacement still starting from an earlier try: one per name
            earlier = self.by_name.get(name)
            if earlier is not None:
                self._retire(name, earlier)
        for name in names:
            self._spawn(known[name])
        replacing = set(names)
        return self._await_all(lambda name: "starting as a replacement" if name in replacing
                               else f"{', '.join(sorted(replacing))} restarted")

    def _retire(self, name: str, process: subprocess.Popen) -> None:
        """Kill an executor's process that is to be replaced, and have the controller forget
        it now: its name is about to connect again."""
        if process.poll() is None:
            process.kill()
            process.wait()
        from flowkit.wire.shm import sweep

        sweep([process.pid])  # the segments a killed executor could not unlink go with it
        for executor in self.controller.executors():
            if executor.pid == process.pid and executor.name == name:
                self.controller.report_lost(executor.id, "replaced by a new process")

    def _await_all(self, doing: Callable[[str], str]) -> list[ExecutorInfo]:
        """Every connected executor, once all `count` are; an ExecutorExited the moment a
        process of this launcher exits meanwhile (`doing(name)`: what it was doing), a
        LaunchError naming those that did not connect at the startup timeout."""
        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                return self.controller.wait_for_executors(self.count, timeout=_WATCH_S)
            except TimeoutError:
                pass
            for name, process in self.by_name.items():
                code = process.poll()
                if code is not None:
                    raise ExecutorExited(name, code, doing(name))
            if time.monotonic() > deadline:
                connected = {e.name for e in self.controller.executors()}
                missing = sorted(set(self.by_name) - connected)
                raise LaunchError(f"{', '.join(missing)} did not connect to "
                                  f"{self.controller.address} within {self.startup_timeout:g} "
                                  f"s (see the executors' output above)")

    def _env(self, i: int) -> dict[str, str]:
        """What executor i's process adds to this one's environment."""
        return {}

    def _forked(self, i: int, env: dict[str, str]) -> ForkedProcess | None:
        """Executor i forked from a fork server, where one can start it; None otherwise."""
        return None

    def _spawn(self, i: int) -> subprocess.Popen | ForkedProcess:
        env = {**os.environ, **thread_env(self.threads), **self._env(i),
               **self.controller.executor_env()}  # the run's secret: never on argv
        # a session of its own: Ctrl-C in the terminal reaches the controller alone, which
        # stops the run cleanly and then shuts its executors down
        process = self._forked(i, env) or spawn(self._command(i), env=env,
                                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.processes.append(process)
        self.by_name[f"{self.name_prefix}-{i}"] = process
        self.controller.watch_process(process)
        return process

    def stop(self, timeout: float = 5.0) -> None:
        # one still starting was never told to shut down (a run that failed as they started):
        # nothing would end it but the timeout
        connected = {e.pid for e in self.controller.executors()}
        for process in self.processes:
            if process.pid not in connected and process.poll() is None:
                process.kill()
        stop_processes(self.processes, timeout)


class LocalExecutors(ProcessExecutors):
    """Start `count` executor processes on this machine connected to `controller`; stop them on
    exit. Each gets its device as runtime/devices.py assigns it [Note: one GPU per executor]:
    a setting this machine cannot honour raises DeviceError here, before any process starts."""

    def __init__(self, controller: Controller, count: int, *, kind: str = "base",
                 tags: Sequence[str] | Sequence[Sequence[str]] = (), device: str = "cpu",
                 name_prefix: str = "exec", log_level: str = "WARNING",
                 startup_timeout: float = 60.0, code: Sequence[str] = (),
                 threads: int = 1) -> None:
        super().__init__(controller, count, name_prefix=name_prefix,
                         startup_timeout=startup_timeout, threads=threads)
        self.kind, self.device, self.log_level = kind, device, log_level
        self.devices = local_devices(device, count)
        self.tags = per_executor_tags(tags, count)
        self.code = [str(path) for path in code]  # flow files whose @op functions may run

    def _command(self, i: int) -> list[str]:
        return [sys.executable, "-m", "executors", "--connect", self.controller.address,
                "--name", f"{self.name_prefix}-{i}", "--kind", self.kind,
                "--device", self.devices[i].device, "--tags", ",".join(self.tags[i]),
                "--log-level", self.log_level, *self.controller.executor_options(),
                *(arg for path in self.code for arg in ("--code", path))]

    def _env(self, i: int) -> dict[str, str]:
        return dict(self.devices[i].env)

    def _forked(self, i: int, env: dict[str, str]) -> ForkedProcess | None:
        # a GPU executor starts afresh: CUDA_VISIBLE_DEVICES must be set before anything in
        # the process touches CUDA, which a fork server cannot promise of what it imported
        if self.devices[i].device != "cpu":
            return None
        return start_executor(self._command(i)[3:], env, preload=preload_for(self.kind))


def thread_env(threads: int) -> dict[str, str]:
    """What an executor's environment says of its compute threads (torch reads it as it
    loads; a forked executor sets it then: executors/forkserver.py)."""
    if threads < 1:
        raise ValueError(f"an executor needs at least 1 thread, not {threads}")
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def stop_processes(processes: Sequence[subprocess.Popen], timeout: float = 5.0) -> None:
    """Wait for executor processes to exit after the controller's shutdown; kill stragglers;
    then remove the shared-memory segments any of them left (one that was SIGKILLed could
    not)."""
    from flowkit.wire.shm import sweep

    for process in processes:
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    sweep(process.pid for process in processes)


def per_executor_tags(tags: Sequence, count: int) -> list[tuple[str, ...]]:
    """One tag list for all (("gpu", "train")) or one per executor ([("rollout",), ("train",)])."""
    if tags and not isinstance(tags[0], str):
        if len(tags) != count:
            raise ValueError(f"{len(tags)} tag lists for {count} executors")
        return [tuple(t) for t in tags]
    return [tuple(tags)] * count
