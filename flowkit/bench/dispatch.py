"""Dispatch benchmark: a no-op through controller -> executor -> resolved future, against a bare
pyzmq DEALER/ROUTER echo of msgpack messages measured in the same run over the same transport.

Method: round trips are timed one at a time (submit, then block on the result), p50 and p99 over
`rounds`; throughput submits `in_flight` no-ops before waiting for all of them. The echo server is
a plain Python loop in its own process, as the executor is, so both sides pay for Python.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time

import msgpack
import zmq

from flowkit.runtime import Controller, LocalExecutors, wait

__all__ = ["run_dispatch_bench"]


def run_dispatch_bench(*, rounds: int = 2000, in_flight: int = 20000,
                       address: str = "tcp://127.0.0.1") -> dict:
    raw = _raw_zmq(rounds=rounds, in_flight=in_flight, address=address)
    ours = _flowkit(rounds=rounds, in_flight=in_flight, address=address)
    return {**ours, **raw, "rtt_ratio": ours["rtt_p50_us"] / raw["raw_zmq_rtt_p50_us"],
            "rounds": rounds, "in_flight": in_flight, "transport": address.split(":")[0]}


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _flowkit(*, rounds: int, in_flight: int, address: str) -> dict:
    with Controller(bind=f"{address}:0") as ctl:
        executors = LocalExecutors(ctl, 1)
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


def _echo_server(address: str) -> None:
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    # unbounded, as the controller's ROUTER: past its high-water mark a ROUTER drops replies
    # silently, and the throughput phase then waits forever for them
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    while True:
        identity, body = sock.recv_multipart()
        message = msgpack.unpackb(body)
        if message.get("t") == "stop":
            break
        sock.send_multipart([identity, msgpack.packb({"t": "done", "id": message["id"]})])
    sock.close(linger=0)
    context.term()


def _raw_zmq(*, rounds: int, in_flight: int, address: str) -> dict:
    context = zmq.Context()
    client = context.socket(zmq.DEALER)
    client.setsockopt(zmq.SNDHWM, 0)
    client.setsockopt(zmq.RCVHWM, 0)
    port = client.bind_to_random_port(address)
    server = multiprocessing.get_context("spawn").Process(
        target=_echo_server, args=(f"{address}:{port}",), daemon=True)
    server.start()
    try:
        def echo(i: int) -> None:
            client.send(msgpack.packb({"t": "run", "id": i, "op": "noop"}))
            msgpack.unpackb(client.recv())

        for i in range(200):
            echo(i)
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
        server.join(5)
    finally:
        if server.is_alive():
            server.kill()
        client.close(linger=0)
        context.term()
    return {"raw_zmq_rtt_p50_us": statistics.median(rtts) * 1e6,
            "raw_zmq_rtt_p99_us": _percentile(rtts, 0.99) * 1e6,
            "raw_zmq_msgs_per_s": in_flight / elapsed}
