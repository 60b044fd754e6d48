"""Local executors: the embedded default, executor subprocesses on this machine."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from flowkit.runtime.controller import Controller
from flowkit.runtime.records import ExecutorInfo

__all__ = ["LocalExecutors", "stop_processes"]


class LocalExecutors:
    """Start `count` executor processes connected to `controller`; stop them on exit.

    Each gets one compute thread (several share the cores) and is watched, so its exit is noticed
    at once rather than at the heartbeat timeout.
    """

    def __init__(self, controller: Controller, count: int, *, kind: str = "base",
                 tags: Sequence[str] | Sequence[Sequence[str]] = (), device: str = "cpu",
                 name_prefix: str = "exec", log_level: str = "WARNING",
                 startup_timeout: float = 60.0, code: Sequence[str] = ()) -> None:
        self.controller, self.count, self.kind, self.device = controller, count, kind, device
        self.tags = _per_executor_tags(tags, count)
        self.name_prefix, self.log_level = name_prefix, log_level
        self.startup_timeout = startup_timeout
        self.code = [str(path) for path in code]  # flow files whose @op functions may run
        self.processes: list[subprocess.Popen] = []
        self.by_name: dict[str, subprocess.Popen] = {}  # the newest process of each executor

    def __enter__(self) -> list[ExecutorInfo]:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        # the processes exit when their controller says so: shut it down first, or stop()
        # waits out its timeout on every one (shutdown is idempotent, `with Controller()` too)
        self.controller.shutdown()
        self.stop()

    def start(self) -> list[ExecutorInfo]:
        for i in range(self.count):
            self._spawn(i)
        try:
            return self.controller.wait_for_executors(self.count, timeout=self.startup_timeout)
        except TimeoutError:
            self.stop()
            raise

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
            if earlier is not None and earlier.poll() is None:
                earlier.kill()
                earlier.wait()
        spawned = [self._spawn(known[name]) for name in names]
        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                return self.controller.wait_for_executors(self.count, timeout=0.5)
            except TimeoutError:
                dead = [p for p in spawned if p.poll() is not None]
                if dead:  # killed too, or it cannot start: say so now, not at the timeout
                    raise RuntimeError(f"a replacement executor exited with code "
                                       f"{dead[0].returncode} before it connected") from None
                if time.monotonic() > deadline:
                    raise

    def _spawn(self, i: int) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "executors", "--connect", self.controller.address,
                   "--name", f"{self.name_prefix}-{i}", "--kind", self.kind,
                   "--device", _device_of(self.device, i), "--tags", ",".join(self.tags[i]),
                   "--log-level", self.log_level, *self.controller.executor_options(),
                   *(arg for path in self.code for arg in ("--code", path))]
        # a session of its own: Ctrl-C in the terminal reaches the controller alone, which
        # stops the run cleanly and then shuts its executors down
        process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
        self.processes.append(process)
        self.by_name[f"{self.name_prefix}-{i}"] = process
        self.controller.watch_process(process)
        return process

    def stop(self, timeout: float = 5.0) -> None:
        stop_processes(self.processes, timeout)


def stop_processes(processes: Sequence[subprocess.Popen], timeout: float = 5.0) -> None:
    """Wait for executor processes to exit after the controller's shutdown; kill stragglers;
    then remove the shared-memory segments any of them left (one that was SIGKILLed could
    not)."""
    from flowkit.runtime.shm import sweep

    for process in processes:
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    sweep(process.pid for process in processes)


def _per_executor_tags(tags: Sequence, count: int) -> list[tuple[str, ...]]:
    """One tag list for all (("gpu", "train")) or one per executor ([("rollout",), ("train",)])."""
    if tags and not isinstance(tags[0], str):
        if len(tags) != count:
            raise ValueError(f"{len(tags)} tag lists for {count} executors")
        return [tuple(t) for t in tags]
    return [tuple(tags)] * count


def _device_of(spec: str, index: int) -> str:
    """Executor `index`'s device: `spec` lists one per executor ('cuda:0,cuda:1', cycled), or
    names one for all; a bare 'cuda' gives executor i the GPU cuda:i."""
    devices = [d.strip() for d in spec.split(",") if d.strip()] or ["cpu"]
    device = devices[index % len(devices)]
    return f"cuda:{index}" if device == "cuda" else device
