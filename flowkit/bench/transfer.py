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
"""

from __future__ import annotations

import statistics
import time

from flowkit.runtime import Controller, LocalExecutors, wait

__all__ = ["run_transfer_bench"]

_SETTLE_S = 0.05  # > the controller's free batching delay (dispatch._FREE_DELAY_S = 20 ms)


def run_transfer_bench(sizes_mib=(1, 16, 64, 256), *, rounds: int = 15,
                       warmup: int = 3) -> dict:
    """{"gbps": {size: GB/s}, "memcpy_gbps": {size: GB/s}, "ratio": {size: ...}, "ratio_64"}
    with sizes in MiB as strings (JSON keys); GB = 1e9 bytes."""
    sizes = [int(s) for s in sizes_mib]
    gbps, memcpy = {}, {}
    with Controller() as ctl, LocalExecutors(ctl, 2, name_prefix="transfer") as started:
        source, target = sorted(started, key=lambda e: e.name)
        for size in sizes:
            gbps[size], memcpy[size] = _measure(ctl, source.id, target.id, size << 20, rounds,
                                                warmup)
    ratio = {size: gbps[size] / memcpy[size] for size in sizes}
    return {"gbps": _keyed(gbps), "memcpy_gbps": _keyed(memcpy), "ratio": _keyed(ratio),
            "ratio_64": ratio.get(64), "sizes_mib": sizes, "rounds": rounds,
            "method": "executor A -> executor B, median round of `nbytes` on B; memcpy: torch "
                      "copy_ on one thread, one between each two transfer rounds"}


def _keyed(values: dict) -> dict:
    return {str(size): round(value, 3) for size, value in values.items()}


def _measure(ctl: Controller, source: int, target: int, nbytes: int, rounds: int,
             warmup: int) -> tuple[float, float]:
    """(transfer GB/s, memcpy GB/s). The two alternate round by round, so a neighbour's load on
    this shared machine weighs on both alike."""
    base = ctl.submit("make_tensor", config={"nbytes": nbytes}, executor=source)
    wait([base])
    memcpy = _Memcpy(nbytes)
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
        copied = memcpy.time()
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


def main() -> None:  # pragma: no cover - `python -m flowkit.bench.transfer`
    import json

    print(json.dumps(run_transfer_bench(), indent=2))


if __name__ == "__main__":  # pragma: no cover
    main()
