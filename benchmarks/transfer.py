"""Transfer benchmark: a tensor moved executor-to-executor, against an in-process memcpy of the same
size measured in the same run.

Method: a controller with two local executors, A and B. A makes a tensor of each size once
(`make_tensor`). Each round gives it a fresh object id on A (`identity`, no copy) and waits for it,
then times only `nbytes` on B with that object as input: the controller tells A to push it, A
lends it through a shared-memory segment (or chunked frames with FLOWKIT_PEER_TRANSPORT=frames),
B runs the op and the completion comes back. GB/s is bytes / median round time. Between rounds the
object is dropped and the benchmark pauses briefly, so B's copy is freed and A's segment is back in
its pool: the figure is the steady state, not the pool's growth. The baseline is torch's
`dst.copy_(src)` into a preallocated buffer on one thread (executors run one compute thread each).

With `hosts=2`, A and B run on two network namespace hosts (flowkit/runtime/netns.py), so the
tensor crosses a veth pair as 1 MiB frames, as between machines, and the baseline is bare pyzmq
across the same two namespaces (benchmarks/peers.py): the bench asks a source process on A's
host to send the same bytes as 1 MiB frames to a sink on B's host, which acks; timed from the
bench's request to the source's reply, as a transfer is from the submit to the completion. The
two alternate round by round, as with the memcpy.

It times transfers, not a flow's steps: it stays on the Controller API, not flowkit.Run.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from benchmarks.peers import curve, spawn
from flowkit.runtime import Controller, LocalExecutors, wait
from flowkit.runtime.netns import HostExecutors, NamespaceHosts
from flowkit.wire.auth import Keys

__all__ = ["run_transfer_bench"]

_SETTLE_S = 0.05  # > the controller's free batching delay (dispatch._FREE_DELAY_S = 20 ms)


def run_transfer_bench(sizes_mib=(1, 16, 64, 256), *, rounds: int = 15,
                       warmup: int = 3, hosts: int = 1) -> dict:
    """{"gbps": {size: GB/s}, "memcpy_gbps": {size: GB/s}, "ratio": {size: ...}, "ratio_64"}
    with sizes in MiB as strings (JSON keys); GB = 1e9 bytes. With hosts=2, "raw_zmq_gbps"
    instead of "memcpy_gbps", and the ratios are against it."""
    sizes = [int(s) for s in sizes_mib]
    gbps, baseline = {}, {}
    with contextlib.ExitStack() as stack:
        if hosts == 1:
            ctl = stack.enter_context(Controller())
            started = stack.enter_context(LocalExecutors(ctl, 2, name_prefix="transfer"))
            make_baseline: Callable[[int], Any] = _Memcpy
        else:
            made = stack.enter_context(NamespaceHosts(hosts))
            # namespace hosts are this machine's: plain across them is a choice, not an accident
            ctl = stack.enter_context(Controller(bind=made.bind, insecure=True))
            started = stack.enter_context(HostExecutors(ctl, made.hosts[:2],
                                                        name_prefix="transfer"))
            raw = stack.enter_context(_RawZmq(made))
            make_baseline = raw.of_size
        source, target = sorted(started, key=lambda e: e.name)
        for size in sizes:
            gbps[size], baseline[size] = _measure(ctl, source.id, target.id, size << 20, rounds,
                                                  warmup, make_baseline(size << 20))
    ratio = {size: gbps[size] / baseline[size] for size in sizes}
    name, method = ("memcpy_gbps", _LOCAL) if hosts == 1 else ("raw_zmq_gbps", _ACROSS)
    return {"gbps": _keyed(gbps), name: _keyed(baseline), "ratio": _keyed(ratio),
            "ratio_64": ratio.get(64), "sizes_mib": sizes, "rounds": rounds, "hosts": hosts,
            "method": method}


_LOCAL = ("executor A -> executor B, median round of `nbytes` on B; memcpy: torch copy_ on one "
          "thread, one between each two transfer rounds")
_ACROSS = ("executor A -> executor B on two network-namespace hosts, median round of `nbytes` "
           "on B; raw zmq: bench -> source on A's host -> sink on B's host (1 MiB frames, ack) "
           "-> source -> bench, one between each two transfer rounds")


def _keyed(values: dict) -> dict:
    return {str(size): round(value, 3) for size, value in values.items()}


def _measure(ctl: Controller, source: int, target: int, nbytes: int, rounds: int,
             warmup: int, baseline: Any) -> tuple[float, float]:
    """(transfer GB/s, baseline GB/s). The two alternate round by round, so a neighbour's load
    on this shared machine weighs on both alike."""
    base = ctl.submit("make_tensor", config={"nbytes": nbytes}, executor=source)
    wait([base])
    transfers, copies = [], []
    for i in range(warmup + rounds):
        moved = ctl.submit("identity", base, executor=source)
        wait([moved])  # exists on A: the timed part is only the move and B's task
        start = time.perf_counter()
        size = ctl.submit("nbytes", moved, executor=target).result(timeout=60)
        elapsed = time.perf_counter() - start
        if size != nbytes:
            raise RuntimeError(f"moved {size} bytes, expected {nbytes}")
        del moved  # freed on both executors: B's copy goes, A's segment returns to its pool
        time.sleep(_SETTLE_S)
        copied = baseline.time()
        if i >= warmup:
            transfers.append(elapsed)
            copies.append(copied)
    return nbytes / statistics.median(transfers) / 1e9, nbytes / statistics.median(copies) / 1e9


class _Memcpy:
    def __init__(self, nbytes: int) -> None:
        import torch

        self.torch = torch
        self.src = torch.ones(nbytes, dtype=torch.uint8)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)  # written: no page faults when timed
        self.dst.copy_(self.src)

    def time(self) -> float:
        threads = self.torch.get_num_threads()
        self.torch.set_num_threads(1)
        try:
            start = time.perf_counter()
            self.dst.copy_(self.src)
            return time.perf_counter() - start
        finally:
            self.torch.set_num_threads(threads)


class _RawZmq:
    """The bare-zmq pair across two namespace hosts: a source on the first, a sink on the second."""

    def __init__(self, made: Any, keys: Keys | None = None) -> None:
        """`made`: NamespaceHosts, or anything with its `hosts` and `gateway`; `keys`: speak
        CURVE (benchmarks/curve.py)."""
        self.made = made
        self.keys = [] if keys is None else [str(keys.folder)]  # the peers' last argument
        self.context = zmq.Context()
        self.control = curve(self.context.socket(zmq.DEALER), "".join(self.keys),
                             serve="controller")
        self.control.setsockopt(zmq.LINGER, 0)
        self.processes: list = []

    def __enter__(self) -> _RawZmq:
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        first, second = self.made.hosts[:2]
        sink = spawn("sink", second.address, *self.keys, prefix=second.prefix)
        self.processes.append(sink)
        port = sink.stdout.readline().strip()
        if not port.isdigit():
            raise RuntimeError(f"the bare-zmq sink did not start (exit code {sink.poll()})")
        bench = self.control.bind_to_random_port(f"tcp://{self.made.gateway}")
        self.processes.append(spawn("source", f"tcp://{self.made.gateway}:{bench}",
                                    f"tcp://{second.address}:{port}", *self.keys,
                                    prefix=first.prefix))
        self._reply("ready")

    def __exit__(self, *exc: Any) -> None:
        with contextlib.suppress(zmq.ZMQError):  # a source that never connected: no one to tell
            self.control.send(msgpack.packb({"t": "stop"}), zmq.NOBLOCK)
        for process in self.processes:  # the source stops the sink
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.control.close()
        self.context.term()

    def of_size(self, nbytes: int) -> _RawRound:
        return _RawRound(self, nbytes)

    def _reply(self, what: str) -> None:
        if not self.control.poll(60_000):
            codes = [p.poll() for p in self.processes]
            raise RuntimeError(f"the bare-zmq source did not say {what!r} (exit codes {codes})")
        self.control.recv()


class _RawRound:
    __slots__ = ("raw", "nbytes")

    def __init__(self, raw: _RawZmq, nbytes: int) -> None:
        self.raw, self.nbytes = raw, nbytes

    def time(self) -> float:
        start = time.perf_counter()
        self.raw.control.send(msgpack.packb({"t": "send", "nbytes": self.nbytes}))
        self.raw._reply("done")
        return time.perf_counter() - start


def main() -> None:  # pragma: no cover - `python -m benchmarks.transfer`
    import json

    print(json.dumps(run_transfer_bench(), indent=2))


if __name__ == "__main__":  # pragma: no cover
    main()
