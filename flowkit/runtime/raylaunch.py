"""Ray as a launcher: each executor a Ray actor in a placement group. Needs the `ray` extra
(`pip install 'flowkit[ray]'`); this module imports ray only when a launcher starts.

The design: [Note: Ray executors] below.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import attrs

from flowkit.runtime.controller import Controller
from flowkit.runtime.devices import wants_gpu
from flowkit.runtime.launch import LaunchError, per_executor_tags, thread_env
from flowkit.runtime.registry import ExecutorInfo
from flowkit.wire.shm import sweep

__all__ = ["STRATEGIES", "RayExecutors", "RaySettings", "check_address", "check_installed",
           "init_ray"]


# [Note: Ray executors] The controller stays in this process. `RayExecutors.start` makes a placement
# group with one bundle per executor ({"GPU": 1} for cuda, else {"CPU": RaySettings.cpus}), PACK
# or SPREAD, and waits for Ray to place it (an unplaceable group is an error after
# `placement_timeout`, not a hang). Executor i is an actor in bundle i whose child is the same
# `python -m executors ...` process a local launcher starts; it connects back over ZeroMQ, which
# carries control and data as for local executors. Ray places and supervises: the child gets
# SIGKILL when its actor's process dies (PR_SET_PDEATHSIG); a watcher thread waiting on each
# actor's long `wait()` call tells the controller at once when one ends or Ray says the actor
# died (`Controller.report_lost`), the heartbeat staying the second path; `stop` kills the
# actors, removes the placement group and sweeps the shared-memory segments the executors left.
# Without an address a local Ray on loopback is started (and stopped); one already initialized
# in this process is used as it is. In full: docs/runtime.md, "Launching through Ray".

STRATEGIES = ("PACK", "SPREAD")
_INSTALL = "pip install 'flowkit[ray]'"


@attrs.frozen(kw_only=True)
class RaySettings:
    """How the Ray launcher places executors and which Ray it uses."""

    address: str | None = None
    """A running cluster (`HOST:PORT`, `ray://HOST:PORT` or `auto`); None starts a local Ray on
    loopback (or joins Ray's own RAY_ADDRESS when that is set)."""
    strategy: str = attrs.field(default="PACK", validator=attrs.validators.in_(STRATEGIES))
    """PACK puts the bundles on as few nodes as fit; SPREAD on as many."""
    cpus: float = attrs.field(default=1.0, validator=attrs.validators.gt(0))
    """Ray CPUs of each CPU executor's bundle (fractional: several executors per core)."""
    placement_timeout: float = attrs.field(default=30.0, validator=attrs.validators.gt(0))
    """How long Ray may take to place the group before it is an error naming what was asked."""
    object_store_mb: int = attrs.field(default=128, validator=attrs.validators.ge(80))
    """A local Ray's object store: flowkit moves no data through it (Ray's minimum is ~75 MB)."""


def check_installed() -> None:
    """A LaunchError naming the extra when ray is not importable."""
    if importlib.util.find_spec("ray") is None:
        raise LaunchError(f"the ray launcher needs Ray, which is not installed: {_INSTALL}")


def check_address(address: str | None, timeout: float = 3.0) -> None:
    """A LaunchError when a `HOST:PORT` (or `ray://HOST:PORT`) address does not answer, before
    ray.init would retry it for a minute; `auto` and None are Ray's to resolve."""
    if address is None or address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise LaunchError(f"Ray address {address!r} is not HOST:PORT, ray://HOST:PORT or auto")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        raise LaunchError(f"no Ray cluster answers at {address} ({exc.strerror or exc}): start "
                          "one (`ray start --head`) or leave the address out to start a local "
                          "Ray") from None


def init_ray(settings: RaySettings, *, cpus: float = 1.0) -> bool:
    """Join the cluster at `settings.address` (or Ray's RAY_ADDRESS), else start a local Ray on
    loopback with `cpus` CPUs (rounded up) and no dashboard; a Ray this process already
    initialized is used as it is. Whether this call initialized Ray (its caller shuts it down)."""
    check_installed()
    import ray

    if ray.is_initialized():
        return False
    address = settings.address or os.environ.get("RAY_ADDRESS") or None
    check_address(address)
    if address is not None:
        ray.init(address=address, logging_level="WARNING")
    else:  # loopback only, sized for the executors: a private local Ray
        ray.init(num_cpus=max(1, math.ceil(cpus)), include_dashboard=False,
                 object_store_memory=settings.object_store_mb * 2**20,
                 _node_ip_address="127.0.0.1", logging_level="WARNING")
    return True


class RayExecutors:
    """`count` executors as Ray actors in a placement group [Note: Ray executors]; the same
    shape as LocalExecutors (flowkit/runtime/launch.py's Launcher)."""

    def __init__(self, controller: Controller, count: int, *, kind: str = "base",
                 tags: Sequence[str] | Sequence[Sequence[str]] = (), device: str = "cpu",
                 name_prefix: str = "exec", log_level: str = "WARNING",
                 startup_timeout: float = 60.0, code: Sequence[str] = (),
                 settings: RaySettings = RaySettings(), threads: int = 1) -> None:
        self.controller, self.count, self.kind = controller, count, kind
        self.threads = threads
        self.tags, self.device = per_executor_tags(tags, count), device
        self.name_prefix, self.log_level = name_prefix, log_level
        self.startup_timeout, self.settings = startup_timeout, settings
        self.code = [os.path.abspath(path) for path in code]  # actors start elsewhere
        self.names = [f"{name_prefix}-{i}" for i in range(count)]
        self.actors: dict[str, Any] = {}  # the newest actor of each executor
        self.killed: list[Any] = []  # actors replaced: killed at stop if still there
        self.local_pids: list[int] = []  # executors on this node, for the sweep
        self._ray: Any = None
        self._owned = False  # whether this launcher started Ray, and so shuts it down
        self._group: Any = None
        self._waits: dict[Any, tuple[str, int]] = {}  # wait() call -> (executor name, pid)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="flowkit-ray-watch",
                                         daemon=True)

    def __enter__(self) -> list[ExecutorInfo]:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.controller.shutdown()  # the executors exit when their controller says so
        self.stop()

    def bundles(self) -> list[dict[str, float]]:
        """One placement-group bundle per executor: a GPU for a cuda device, else CPUs."""
        return [{"GPU": 1.0} if gpu else {"CPU": self.settings.cpus}
                for gpu in wants_gpu(self.device, self.count)]

    def start(self) -> list[ExecutorInfo]:
        """Place the group, start an actor per bundle; the executors once all are connected,
        in the order of their index."""
        try:
            self._connect()
            self._place()
            self._launch(self.names)
            self._watcher.start()
        except BaseException:
            self.stop()
            raise
        order = {name: i for i, name in enumerate(self.names)}
        joined = self.controller.executors()
        return sorted(joined, key=lambda e: order.get(e.name, len(order)))

    def replace(self, names: Sequence[str]) -> list[ExecutorInfo]:
        """A new actor, in the same bundle, for each lost executor of `names`; every connected
        executor once they are in."""
        unknown = sorted(set(names) - set(self.names))
        if unknown:
            raise ValueError(f"{unknown} are not executors this launcher started")
        for name in names:
            earlier = self.actors.pop(name, None)
            if earlier is not None:  # its bundle's resources come back once it is gone
                self.killed.append(earlier)
                self._ray.kill(earlier, no_restart=True)
        self._launch(names)
        return self.controller.executors()

    def stop(self, timeout: float = 5.0) -> None:
        """After the controller's shutdown: let the executors exit, kill the actors, remove the
        group and the segments; shut Ray down if this launcher started it."""
        self._stopping.set()
        if self._watcher.is_alive():
            self._watcher.join()
        ray = self._ray
        if ray is None:
            return
        with self._lock:
            pending = list(self._waits)
        if pending:
            ray.wait(pending, num_returns=len(pending), timeout=timeout)
        for actor in [*self.actors.values(), *self.killed]:
            with contextlib.suppress(Exception):  # already dead: nothing to kill
                ray.kill(actor, no_restart=True)
        self.actors.clear()
        self.killed.clear()
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self._group)
            self._group = None
        _wait_gone(self.local_pids, timeout)  # SIGKILLed once their actor's process is gone
        sweep(self.local_pids)
        if self._owned:
            ray.shutdown()
            self._owned = False
        self._ray = None

    # -- starting -----------------------------------------------------------------------------
    def _connect(self) -> None:
        import ray

        needed = sum(b.get("CPU", 0.0) for b in self.bundles())
        self._owned = init_ray(self.settings, cpus=needed)
        self._ray = ray

    def _place(self) -> None:
        from ray.exceptions import GetTimeoutError
        from ray.util.placement_group import placement_group, remove_placement_group

        bundles, strategy = self.bundles(), self.settings.strategy
        self._group = placement_group(bundles, strategy=strategy)
        try:
            self._ray.get(self._group.ready(), timeout=self.settings.placement_timeout)
        except GetTimeoutError:
            remove_placement_group(self._group)
            self._group = None
            asked = ", ".join(f"{n} x {b}" for b, n in _counted(bundles))
            has = {k: v for k, v in self._ray.cluster_resources().items()
                   if k in ("CPU", "GPU")}
            raise LaunchError(
                f"Ray could not place the executors' bundles ({asked}, {strategy}) within "
                f"{self.settings.placement_timeout:g} s: the cluster has {has}. Give fewer "
                "executors, fewer CPUs each (--ray-cpus), --device cpu, or a cluster with the "
                "resources") from None

    def _launch(self, names: Sequence[str]) -> None:
        """Start an actor for each of `names` in its bundle; return once all have connected."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        index = {name: i for i, name in enumerate(self.names)}
        actor_class, bundles = self._ray.remote(_ExecutorActor), self.bundles()
        calls = {}
        for name in names:
            i = index[name]
            bundle = bundles[i]
            actor = actor_class.options(
                num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._group, placement_group_bundle_index=i),
            ).remote()
            self.actors[name] = actor
            calls[name] = actor.start.remote(self._arguments(i), {
                **thread_env(self.threads), **self.controller.executor_env()})
        here = self._ray.get_runtime_context().get_node_id()
        waits = {}
        for name, call in calls.items():
            pid, node = self._started(name, call)
            if node == here:
                self.local_pids.append(pid)
            waits[name] = self.actors[name].wait.remote()
            with self._lock:  # the watcher's from now on
                self._waits[waits[name]] = (name, pid)
        self._wait_connected(waits)

    def _started(self, name: str, call: Any) -> tuple[int, str]:
        """The pid and node of executor `name` once its actor started it; a LaunchError naming
        it when the actor could not (it died, or Ray never scheduled it)."""
        from ray.exceptions import GetTimeoutError, RayError

        try:
            return self._ray.get(call, timeout=self.startup_timeout)
        except GetTimeoutError:
            raise LaunchError(f"executor {name}'s Ray actor did not start within "
                              f"{self.startup_timeout:g} s") from None
        except RayError as exc:
            raise LaunchError(f"executor {name}'s Ray actor could not start it: "
                              f"{str(exc).splitlines()[0]}") from None

    def _wait_connected(self, waits: dict[str, Any]) -> None:
        """Until every executor is connected; a LaunchError as soon as one of those just
        started (`waits`: name -> its actor's wait() call) ended instead."""
        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                self.controller.wait_for_executors(self.count, timeout=0.5)
                return
            except TimeoutError:
                ended = [(name, ref) for name, ref in waits.items() if _done(self._ray, ref)]
                if ended:  # killed too, or it cannot start: say so now, not at the timeout
                    name, ref = ended[0]
                    raise LaunchError(f"executor {name} ended before it connected to the "
                                      f"controller: {self._why(ref)}") from None
                if time.monotonic() > deadline:
                    raise

    def _arguments(self, i: int) -> list[str]:
        """What executor i's actor passes to `python -m executors`; under Ray a GPU executor
        sees only the GPU of its bundle, as cuda:0."""
        device = "cuda:0" if wants_gpu(self.device, self.count)[i] else "cpu"
        return ["--connect", self.controller.address, "--name", self.names[i],
                "--kind", self.kind, "--device", device, "--tags", ",".join(self.tags[i]),
                "--log-level", self.log_level, *self.controller.executor_options(),
                *(arg for path in self.code for arg in ("--code", path))]

    # -- watching -----------------------------------------------------------------------------
    def _watch(self) -> None:
        """Tell the controller of each executor whose actor call ended while the run goes on."""
        while not self._stopping.is_set():
            with self._lock:
                pending = list(self._waits)
            if not pending:
                self._stopping.wait(0.05)
                continue
            done, _ = self._ray.wait(pending, num_returns=1, timeout=0.1)
            for ref in done:
                with self._lock:
                    name, pid = self._waits.pop(ref)
                if not self._stopping.is_set():
                    self._report(name, pid, self._why(ref))

    def _why(self, ref: Any) -> str:
        from ray.exceptions import RayActorError

        try:
            code = self._ray.get(ref)
        except RayActorError as exc:
            lines = [line.strip() for line in str(exc).splitlines()]
            cause = next((line for line in lines if line.startswith("The actor is dead")),
                         lines[0] if lines else type(exc).__name__)
            return f"its Ray actor died ({cause})"
        return f"its process exited with code {code}"

    def _report(self, name: str, pid: int, reason: str) -> None:
        for executor in self.controller.executors():
            if executor.name == name and executor.pid == pid:
                self.controller.report_lost(executor.id, reason)


class _ExecutorActor:
    """Runs one flowkit executor process where Ray placed this actor, and dies with it."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None

    def start(self, arguments: list[str], env: dict[str, str]) -> tuple[int, str]:
        """Start the executor; its pid and this node's id."""
        import ray

        self.process = subprocess.Popen(
            [sys.executable, "-m", "executors", *arguments], env={**os.environ, **env},
            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
        return self.process.pid, ray.get_runtime_context().get_node_id()

    def wait(self) -> int:
        """The executor's exit code, once it exits; its host's segments swept."""
        code = self.process.wait()
        sweep([self.process.pid])
        return code


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the actor's thread that started it dies. Only
    Linux has it; elsewhere a killed actor's executor exits at its heartbeat timeout."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _done(ray: Any, ref: Any) -> bool:
    return bool(ray.wait([ref], timeout=0)[0])


def _counted(bundles: list[dict]) -> list[tuple[dict, int]]:
    counts: dict[tuple, int] = {}
    for bundle in bundles:
        key = tuple(sorted(bundle.items()))
        counts[key] = counts.get(key, 0) + 1
    return [(dict(key), n) for key, n in counts.items()]


def _wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for pid in pids:
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.02)


def _running(pid: int) -> bool:
    """Whether process `pid` runs: a zombie no longer does (an orphan's reaper may be slow)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
