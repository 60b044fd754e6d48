"""Launch benchmark: how long executors take to start and connect under Ray, against local
subprocesses measured side by side in the same run.

Method: each round starts `executors` torch executors with the local launcher, then with the
Ray launcher (alternating, so both see the same machine load), and times `start()`, from the
call until every executor has connected to the controller, and `stop()` after the controller's
shutdown. A Ray launch places a placement group, starts an actor per bundle and the executor
process inside it; the local Ray itself is started once, before the rounds, and its start-up is
reported apart (`ray_init_s`): a cluster runs long before and after a run.

It times executors' start-up, not a flow's steps: it stays on the Controller API, not flowkit.Run.
"""

from __future__ import annotations

import statistics
import time

from flowkit.runtime import Controller
from flowkit.runtime.launchers import make_launcher
from flowkit.runtime.raylaunch import RaySettings, init_ray

__all__ = ["run_launch_bench"]


def run_launch_bench(*, executors: int = 2, rounds: int = 5, kind: str = "torch") -> dict:
    started = time.perf_counter()
    owned = init_ray(RaySettings(), cpus=executors)
    ray_init_s = time.perf_counter() - started
    times: dict[str, dict[str, list[float]]] = {name: {"start": [], "stop": []}
                                               for name in ("local", "ray")}
    try:
        for _ in range(rounds):
            for name in ("local", "ray"):
                start_s, stop_s = _launch(name, executors=executors, kind=kind)
                times[name]["start"].append(start_s)
                times[name]["stop"].append(stop_s)
    finally:
        if owned:
            import ray

            ray.shutdown()
    figures = {f"{name}_{what}_s": statistics.median(samples)
               for name, by_what in times.items() for what, samples in by_what.items()}
    return {**figures, "ray_start_ratio": figures["ray_start_s"] / figures["local_start_s"],
            "ray_init_s": ray_init_s if owned else None, "executors": executors,
            "rounds": rounds, "kind": kind}


def _launch(name: str, *, executors: int, kind: str) -> tuple[float, float]:
    """(seconds until `executors` executors of launcher `name` connected, seconds to stop)."""
    with Controller() as ctl:
        launcher = make_launcher(name, ctl, executors, kind=kind, tags=[()] * executors,
                                 settings=RaySettings() if name == "ray" else None)
        begin = time.perf_counter()
        launcher.start()
        connected = time.perf_counter()
        ctl.submit("noop").result(timeout=30)  # they serve, not only connect
        ctl.shutdown()
        stopping = time.perf_counter()
        launcher.stop()
        return connected - begin, time.perf_counter() - stopping
