"""`flowkit bench dispatch|transfer --curve`: what CurveZMQ [Note: authenticated transport in
flowkit/wire/auth.py] costs a dispatch round trip and a transfer, each against bare zmq.

Method: four sides are started and kept alive together: flowkit plain, flowkit with CURVE (fresh
keys; the controller's and executors' gates admit the executor key), bare zmq plain and bare zmq
with CURVE (the same keys, the bench as the controller, its peers as executors: benchmarks/
peers.py). The sides take turns (100 round trips each for dispatch, so each is timed warm; one
transfer each), so a neighbour's load on this shared machine weighs on all four alike; figures
are medians over the rounds.

- dispatch: a no-op submitted and waited for, against a msgpack echo (as benchmarks/
  dispatch.py, one at a time).
- transfer: a tensor moved executor A -> B, timed as `nbytes` on B (as benchmarks/
  transfer.py), against a source sending the same bytes as 1 MiB frames to a sink that acks.
  On one host the executors are told to send frames (FLOWKIT_PEER_TRANSPORT=frames), as to
  another host: over shared memory only a handle crosses the socket, leaving nothing to encrypt.

`cost` is CURVE's time over plain's for each (flowkit and bare zmq); `ratio` flowkit's over bare
zmq's with the same security. With hosts=2 everything runs across network-namespace hosts.

It times round trips and transfers, not a flow's steps: it stays on the Controller API.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import zmq

from benchmarks.peers import curve, curve_keys, spawn
from benchmarks.transfer import _SETTLE_S, _RawZmq
from flowkit.runtime import Controller, LocalExecutors, wait
from flowkit.runtime.netns import Host, HostExecutors, NamespaceHosts
from flowkit.wire.auth import Keys

__all__ = ["run_dispatch_curve", "run_transfer_curve"]

# Round trips a side runs in one turn: taking turns every round trip would time every side
# cold (an idle executor sleeps in poll after a millisecond [Note: hot polling] in
# executors/process.py), which no steady dispatch is.
_DISPATCH_BLOCK = 100

def run_dispatch_curve(*, rounds: int = 2000, warmup: int = 200, hosts: int = 1) -> dict:
    """Round-trip p50 and p99 (µs) of each side, with `cost` and `ratio`."""
    with _places(hosts) as (places, keys), contextlib.ExitStack() as stack:
        far = places.hosts[0] if hosts > 1 else None
        timers: dict[str, Callable[[], float]] = {}
        for side, used in (("plain", None), ("curve", keys)):
            ctl = stack.enter_context(_controller(places, used, hosts))
            stack.enter_context(LocalExecutors(ctl, 1) if far is None
                                else HostExecutors(ctl, [far]))
            timers[side] = _noop_round(ctl)
            timers[f"raw_zmq_{side}"] = stack.enter_context(_Echo(places, far, used)).round
        samples = _alternate(timers, rounds, warmup, block=_DISPATCH_BLOCK)
    p50 = {side: statistics.median(s) * 1e6 for side, s in samples.items()}
    return {"rtt_p50_us": _rounded(p50),
            "rtt_p99_us": _rounded({side: _p99(s) * 1e6 for side, s in samples.items()}),
            **_cost_and_ratio(p50), "rounds": rounds, "hosts": hosts,
            "method": f"sides taking turns of {_DISPATCH_BLOCK} round trips: flowkit no-op "
                      "submit -> result, bare zmq msgpack echo; plain and CURVE"}


def run_transfer_curve(sizes_mib=(16, 64), *, rounds: int = 10, warmup: int = 2,
                       hosts: int = 1) -> dict:
    """GB/s (1e9 bytes) of each side per size in MiB, with `cost` and `ratio` per size."""
    sizes = [int(s) for s in sizes_mib]
    figures: dict = {"gbps": {}, "cost": {}, "ratio": {}}
    with _places(hosts) as (places, keys), _frames_between_executors(hosts), \
            contextlib.ExitStack() as stack:
        pairs, raws = {}, {}
        for side, used in (("plain", None), ("curve", keys)):
            ctl = stack.enter_context(_controller(places, used, hosts))
            started = stack.enter_context(
                LocalExecutors(ctl, 2, name_prefix="transfer") if hosts == 1 else
                HostExecutors(ctl, places.hosts[:2], name_prefix="transfer"))
            pairs[side] = (ctl, *sorted(started, key=lambda e: e.name))
            raws[side] = stack.enter_context(_RawZmq(places, keys=used))
        for size in sizes:
            nbytes = size << 20
            timers = {side: _transfer_round(*pairs[side], nbytes) for side in pairs}
            timers.update({f"raw_zmq_{side}": raws[side].of_size(nbytes).time for side in raws})
            samples = _alternate(timers, rounds, warmup)
            gbps = {side: nbytes / statistics.median(s) / 1e9 for side, s in samples.items()}
            figures["gbps"][str(size)] = _rounded(gbps)
            # GB/s is 1/time: plain over CURVE is CURVE's time over plain's, as in dispatch
            per_time = {side: 1 / value for side, value in gbps.items()}
            derived = _cost_and_ratio(per_time)
            figures["cost"][str(size)], figures["ratio"][str(size)] = (
                derived["cost"], {k: round(1 / v, 3) for k, v in derived["ratio"].items()})
    return {**figures, "sizes_mib": sizes, "rounds": rounds, "hosts": hosts,
            "method": "alternating round by round: executor A -> executor B as 1 MiB frames, "
                      "`nbytes` on B; bare zmq: bench -> source -> sink (1 MiB frames, ack) -> "
                      "source -> bench; plain and CURVE. ratio: flowkit GB/s over bare zmq's"}


# -- places and sides ----------------------------------------------------------------------------
class _ThisHost:
    """Two places on this machine, as NamespaceHosts gives them: everything on loopback."""

    gateway = "127.0.0.1"
    bind = "tcp://127.0.0.1:0"
    hosts = [Host(id="a"), Host(id="b")]


@contextlib.contextmanager
def _places(hosts: int) -> Iterator[tuple[Any, Keys]]:
    with curve_keys(True) as keys:
        if hosts == 1:
            yield _ThisHost(), keys
        else:
            with NamespaceHosts(hosts) as made:
                yield made, keys


def _controller(places: Any, keys: Keys | None, hosts: int) -> Controller:
    # namespace hosts are this machine's: plain across them is a choice, not an accident
    return Controller(bind=places.bind, keys=keys, insecure=keys is None and hosts > 1)


@contextlib.contextmanager
def _frames_between_executors(hosts: int) -> Iterator[None]:
    """Executors started inside send one another frames, as to another host."""
    before = os.environ.get("FLOWKIT_PEER_TRANSPORT")
    if hosts == 1:
        os.environ["FLOWKIT_PEER_TRANSPORT"] = "frames"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("FLOWKIT_PEER_TRANSPORT", None)
        else:
            os.environ["FLOWKIT_PEER_TRANSPORT"] = before


def _noop_round(ctl: Controller) -> Callable[[], float]:
    def round_trip() -> float:
        start = time.perf_counter()
        ctl.submit("noop").result(timeout=60)
        return time.perf_counter() - start
    return round_trip


def _transfer_round(ctl: Controller, source: Any, target: Any,
                    nbytes: int) -> Callable[[], float]:
    base = ctl.submit("make_tensor", config={"nbytes": nbytes}, executor=source.id)
    wait([base])

    def transfer() -> float:
        moved = ctl.submit("identity", base, executor=source.id)
        wait([moved])  # exists on A: the timed part is only the move and B's task
        start = time.perf_counter()
        size = ctl.submit("nbytes", moved, executor=target.id).result(timeout=60)
        elapsed = time.perf_counter() - start
        if size != nbytes:
            raise RuntimeError(f"moved {size} bytes, expected {nbytes}")
        del moved
        time.sleep(_SETTLE_S)  # B's copy freed before the next side's round
        return elapsed
    return transfer


class _Echo:
    """A bare-zmq msgpack echo peer (benchmarks/peers.py), plain or CURVE."""

    def __init__(self, places: Any, host: Host | None, keys: Keys | None) -> None:
        self.context = zmq.Context()
        folder = [] if keys is None else [str(keys.folder)]
        self.client = curve(self.context.socket(zmq.DEALER), "".join(folder),
                            serve="controller")
        for option in (zmq.SNDHWM, zmq.RCVHWM, zmq.LINGER):
            self.client.setsockopt(option, 0)
        port = self.client.bind_to_random_port(f"tcp://{places.gateway}")
        self.server = spawn("echo", f"tcp://{places.gateway}:{port}", *folder,
                            prefix=host.prefix if host else ())
        self.request = msgpack.packb({"t": "run", "id": 0, "op": "noop"})

    def __enter__(self) -> _Echo:
        self.client.send(self.request)
        if not self.client.poll(30_000):  # a server that failed to start must not hang
            self.__exit__()
            raise RuntimeError(f"the echo server did not answer (exit code {self.server.poll()})")
        self.client.recv()
        return self

    def round(self) -> float:
        start = time.perf_counter()
        self.client.send(self.request)
        msgpack.unpackb(self.client.recv())
        return time.perf_counter() - start

    def __exit__(self, *exc: Any) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.client.send(msgpack.packb({"t": "stop"}), zmq.NOBLOCK)
        try:
            self.server.wait(5)
        except Exception:
            self.server.kill()
            self.server.wait()
        self.client.close(linger=0)
        self.context.term()


# -- figures -------------------------------------------------------------------------------------
def _alternate(timers: dict[str, Callable[[], float]], rounds: int, warmup: int,
               block: int = 1) -> dict[str, list[float]]:
    """`rounds` timings of each side, taking turns `block` rounds at a time, after `warmup`
    untimed rounds of each; the first rounds of a turn (a tenth) are not timed either, so a side
    is timed warm, as it runs in steady state, while the turns spread the machine's noise."""
    samples: dict[str, list[float]] = {side: [] for side in timers}
    for timer in timers.values():
        for _ in range(warmup):
            timer()
    settle = block // 10
    while len(next(iter(samples.values()))) < rounds:
        for side, timer in timers.items():
            for i in range(settle + block):
                elapsed = timer()
                if i >= settle and len(samples[side]) < rounds:
                    samples[side].append(elapsed)
    return samples


def _cost_and_ratio(times: dict[str, float]) -> dict:
    """From each side's time: what CURVE costs (its time over plain's), and flowkit's time over
    bare zmq's at the same security."""
    return {"cost": _rounded({"flowkit": times["curve"] / times["plain"],
                              "raw_zmq": times["raw_zmq_curve"] / times["raw_zmq_plain"]}),
            "ratio": _rounded({"plain": times["plain"] / times["raw_zmq_plain"],
                               "curve": times["curve"] / times["raw_zmq_curve"]})}


def _p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _rounded(values: dict) -> dict:
    return {key: round(value, 3) for key, value in values.items()}
