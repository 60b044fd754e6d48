"""Launch benchmark: how long executors take to start and connect, started as fresh processes,
forked from a fork server (cold: the server started with them, as a run's first launch; warm:
one already up, as a restart or a second launch finds it), and under Ray where it is installed,
measured side by side in the same run.

Method: each round starts `executors` torch executors each way (alternating, so all see the
same machine load) and times `start()`, from the call until every executor has connected to
the controller, `replace()` of one of them (a restart after a lost executor), and `stop()`
after the controller's shutdown. A Ray launch places a placement group, starts an actor per
bundle and the executor process inside it; the local Ray itself is started once, before the
rounds, and its start-up is reported apart (`ray_init_s`): a cluster runs long before and after
a run.

It times executors' start-up, not a flow's steps: it stays on the Controller API, not flowkit.Run.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterator

from flowkit.runtime import Controller
from flowkit.runtime.forkserver import start_server
from flowkit.runtime.launch import preload_for
from flowkit.runtime.launchers import make_launcher

__all__ = ["run_launch_bench"]

_WAYS = ("fresh", "forked_cold", "forked_warm", "ray")


def run_launch_bench(*, executors: int = 2, rounds: int = 5, kind: str = "torch",
                     ray: bool | None = None) -> dict:
    """`ray`: None measures Ray where it is installed."""
    ray = _ray_installed() if ray is None else ray
    ways = [w for w in _WAYS if ray or w != "ray"]
    owned, ray_init_s = _start_ray(executors) if ray else (False, None)
    times = {way: {"start": [], "replace": [], "stop": []} for way in ways}
    warm = start_server(preload_for(kind))
    try:
        for _ in range(rounds):
            for way in ways:
                for what, seconds in _launch(way, executors, kind, warm.path).items():
                    times[way][what].append(seconds)
    finally:
        warm.close()
        if owned:
            import ray as ray_module

            ray_module.shutdown()
    figures = {f"{way}_{what}_s": statistics.median(samples)
               for way, by_what in times.items() for what, samples in by_what.items()}
    ratios = {f"{way}_start_ratio": figures[f"{way}_start_s"] / figures["fresh_start_s"]
              for way in ways if way != "fresh"}
    ratios["forked_warm_replace_ratio"] = (figures["forked_warm_replace_s"]
                                           / figures["fresh_replace_s"])
    return {**figures, **ratios, "ray_init_s": ray_init_s, "executors": executors,
            "rounds": rounds, "kind": kind}


def _ray_installed() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def _start_ray(executors: int) -> tuple[bool, float | None]:
    from flowkit.runtime.raylaunch import RaySettings, init_ray

    started = time.perf_counter()
    owned = init_ray(RaySettings(), cpus=executors)
    return owned, (time.perf_counter() - started) if owned else None


@contextlib.contextmanager
def _fork_server_setting(value: str | None) -> Iterator[None]:
    """FLOWKIT_FORKSERVER set to `value` (None: unset) for what the block starts."""
    before = os.environ.get("FLOWKIT_FORKSERVER")
    if value is None:
        os.environ.pop("FLOWKIT_FORKSERVER", None)
    else:
        os.environ["FLOWKIT_FORKSERVER"] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("FLOWKIT_FORKSERVER", None)
        else:
            os.environ["FLOWKIT_FORKSERVER"] = before


def _launch(way: str, executors: int, kind: str, warm_path: str) -> dict[str, float]:
    """Seconds until `executors` executors started `way` connected (a cold fork server's own
    start included), to replace one, and to stop them."""
    begin = time.perf_counter()
    cold = None
    if way == "forked_cold":
        cold = start_server(preload_for(kind))
    setting = {"fresh": "off", "forked_cold": cold and cold.path, "forked_warm": warm_path,
               "ray": "off"}[way]
    try:
        with _fork_server_setting(setting), Controller() as ctl:
            settings = None
            if way == "ray":
                from flowkit.runtime.raylaunch import RaySettings

                settings = RaySettings()
            launcher = make_launcher("ray" if way == "ray" else "local", ctl, executors,
                                     kind=kind, tags=[()] * executors, settings=settings)
            launcher.start()
            connected = time.perf_counter()
            ctl.submit("noop").result(timeout=30)  # they serve, not only connect
            replacing = time.perf_counter()
            launcher.replace([f"exec-{executors - 1}"])
            ctl.submit("noop").result(timeout=30)
            replaced = time.perf_counter()
            ctl.shutdown()
            stopping = time.perf_counter()
            launcher.stop()
            return {"start": connected - begin, "replace": replaced - replacing,
                    "stop": time.perf_counter() - stopping}
    finally:
        if cold is not None:
            cold.close()
