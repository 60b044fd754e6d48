"""Dispatch benchmark: a no-op through controller -> executor -> resolved future, against a bare
pyzmq DEALER/ROUTER echo of msgpack messages measured in the same run over the same transport.

Method: round trips are timed one at a time (submit, then block on the result), p50 and p99 over
`rounds`; throughput submits `in_flight` no-ops before waiting for all of them. The echo server is
a plain Python loop in its own process, as the executor is, so both sides pay for Python.

With `hosts=2` both run across network namespace hosts (flowkit/runtime/netns.py): the
controller and the echo client bind on the bridge, the executor and the echo server run on a
namespace host, so every message crosses a veth pair as between machines.

It times no-op round trips, not a flow's steps: it stays on the Controller API, not flowkit.Run.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator

import msgpack
import zmq

from benchmarks.peers import spawn
from flowkit.runtime import Controller, LocalExecutors, wait
from flowkit.runtime.netns import Host, HostExecutors, NamespaceHosts

__all__ = ["run_dispatch_bench"]


def run_dispatch_bench(*, rounds: int = 2000, in_flight: int = 20000,
                       address: str = "tcp://127.0.0.1", hosts: int = 1) -> dict:
    with _placed(hosts, address) as (address, host):
        raw = _raw_zmq(rounds=rounds, in_flight=in_flight, address=address, host=host)
        ours = _flowkit(rounds=rounds, in_flight=in_flight, address=address, host=host)
    return {**ours, **raw, "rtt_ratio": ours["rtt_p50_us"] / raw["raw_zmq_rtt_p50_us"],
            "rounds": rounds, "in_flight": in_flight, "transport": address.split(":")[0],
            "hosts": hosts}


@contextlib.contextmanager
def _placed(hosts: int, address: str) -> Iterator[tuple[str, Host | None]]:
    """(the address to bind on, the host the far side runs on: None for this one)."""
    if hosts == 1:
        yield address, None
        return
    with NamespaceHosts(hosts) as made:
        yield f"tcp://{made.gateway}", made.hosts[0]


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _flowkit(*, rounds: int, in_flight: int, address: str, host: Host | None) -> dict:
    # namespace hosts are this machine's: plain across them is a choice, not an accident
    with Controller(bind=f"{address}:0", insecure=host is not None) as ctl:
        executors = LocalExecutors(ctl, 1) if host is None else HostExecutors(ctl, [host])
        executors.start()
        try:
            for _ in range(200):  # warm up both processes
                ctl.submit("noop").result()
            rtts = []
            for _ in range(rounds):
                start = time.perf_counter()
                ctl.submit("noop").result()
                rtts.append(time.perf_counter() - start)
            start = time.perf_counter()
            futures = [ctl.submit("noop") for _ in range(in_flight)]
            wait(futures)
            elapsed = time.perf_counter() - start
        finally:
            ctl.shutdown()
            executors.stop()
    return {"rtt_p50_us": statistics.median(rtts) * 1e6,
            "rtt_p99_us": _percentile(rtts, 0.99) * 1e6, "ops_per_s": in_flight / elapsed}


def _raw_zmq(*, rounds: int, in_flight: int, address: str, host: Host | None) -> dict:
    context = zmq.Context()
    client = context.socket(zmq.DEALER)
    client.setsockopt(zmq.SNDHWM, 0)
    client.setsockopt(zmq.RCVHWM, 0)
    port = client.bind_to_random_port(address)
    server = spawn("echo", f"{address}:{port}", prefix=host.prefix if host else ())
    try:
        def echo(i: int) -> None:
            client.send(msgpack.packb({"t": "run", "id": i, "op": "noop"}))
            msgpack.unpackb(client.recv())

        for i in range(200):
            client.send(msgpack.packb({"t": "run", "id": i, "op": "noop"}))
            if not client.poll(30_000):  # a server that failed to start must not hang the bench
                raise RuntimeError(f"the echo server did not answer (exit code {server.poll()})")
            client.recv()
        rtts = []
        for i in range(rounds):
            start = time.perf_counter()
            echo(i)
            rtts.append(time.perf_counter() - start)
        start = time.perf_counter()
        for i in range(in_flight):
            client.send(msgpack.packb({"t": "run", "id": i, "op": "noop"}))
        for _ in range(in_flight):
            msgpack.unpackb(client.recv())
        elapsed = time.perf_counter() - start
        client.send(msgpack.packb({"t": "stop"}))
        server.wait(5)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        client.close(linger=0)
        context.term()
    return {"raw_zmq_rtt_p50_us": statistics.median(rtts) * 1e6,
            "raw_zmq_rtt_p99_us": _percentile(rtts, 0.99) * 1e6,
            "raw_zmq_msgs_per_s": in_flight / elapsed}
