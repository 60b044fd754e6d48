"""[Note: device time] in executors/torch/device.py: an executor calls its kind's op-end hooks
after every op, before it reads the clock that ends the op, and the torch kind's hook waits for
a CUDA device's kernels (here a stub of torch.cuda stands in for one) and does nothing on the
CPU; profiled F/B/W times are read the same way."""

from __future__ import annotations

import threading

import torch

from executors.optable import OpContext, builtin_ops
from executors.process import Executor
from executors.torch import device
from executors.torch.train.pipeline_ops import _profile_once
from flowkit.runtime import Controller


class _Stream:
    def __init__(self, device, synced: list[str]) -> None:
        self.device, self.synced = device, synced

    def synchronize(self) -> None:
        self.synced.append(f"stream {self.device}")


def _stub_cuda(monkeypatch, initialized: bool = True) -> list[str]:
    synced: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: synced.append(str(d)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: _Stream(d, synced))
    return synced


def test_every_op_ends_with_the_kinds_hook_before_its_end_is_read():
    table = builtin_ops()
    seen: list[tuple[str, bool]] = []
    executor: list[Executor] = []
    table.on_op_end(lambda ctx: seen.append((ctx.name, executor[0].in_op)))
    with Controller() as ctl:
        executor.append(Executor(connect=ctl.address, name="hooked", ops=table,
                                 secret=ctl.secret))
        thread = threading.Thread(target=executor[0].serve, daemon=True)
        thread.start()
        ctl.wait_for_executors(1, timeout=30)
        info = ctl.executors()[0]
        futures = [ctl.submit("identity", i, executor=info.id) for i in range(5)]
        assert [f.result(timeout=10) for f in futures] == list(range(5))
        failed = ctl.submit("fail", executor=info.id)
        assert failed.exception(timeout=10) is not None
    thread.join(timeout=10)
    # once per op that returned, inside the op (the clock that ends it is read after)
    assert seen == [("hooked", True)] * 5


def test_a_hook_is_registered_once():
    table = builtin_ops()
    table.on_op_end(device.synchronize_op)
    table.on_op_end(device.synchronize_op)
    assert table.op_end_hooks == [device.synchronize_op]


def test_the_torch_kind_registers_the_device_sync():
    from executors.kinds import op_table

    assert device.synchronize_op in op_table("torch").op_end_hooks
    assert op_table("base").op_end_hooks == []


def test_the_sync_waits_for_a_cuda_devices_current_stream_and_does_nothing_on_the_cpu(
        monkeypatch):
    synced = _stub_cuda(monkeypatch)
    for name in ("cpu", "", "auto", "cudax", "cuda:1", "cuda"):
        device.synchronize_op(OpContext(name="e", device=name, tags=()))
    assert synced == ["stream cuda:1", "stream cuda"]  # not the device: a collective's stream


def test_the_sync_leaves_a_process_that_never_used_cuda_alone(monkeypatch):
    synced = _stub_cuda(monkeypatch, initialized=False)
    device.synchronize_op(OpContext(name="e", device="cuda:0", tags=()))
    assert synced == []


def test_the_device_clock_syncs_a_cuda_device_before_reading(monkeypatch):
    synced = _stub_cuda(monkeypatch)
    assert device.device_clock(torch.device("cpu")) is device.time.perf_counter
    clock = device.device_clock(torch.device("cuda", 0))
    first, second = clock(), clock()
    assert second >= first and synced == ["cuda:0", "cuda:0"]


class _FakeRunner:
    """A stage on a 'CUDA' device whose ops only count: what _profile_once times."""

    device = torch.device("cuda", 2)

    def __init__(self, log: list) -> None:
        self.log = log

    def forward(self, key, *args):
        self.log.append("F")
        return torch.zeros(2)

    def backward(self, key, *grads):
        self.log.append("BW")

    def backward_input(self, key, *grads):
        self.log.append("B")

    def backward_weight(self, key):
        self.log.append("W")


def test_profiled_times_start_and_end_with_the_stage_device_synced(monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: log.append(f"sync {d}"))
    spent = _profile_once(_FakeRunner(log), "k", [], fused=False, last=True)
    assert set(spent) == {"F", "B", "W"}
    sync = "sync cuda:2"
    assert log == [sync, "F", sync, sync, "B", sync, sync, "W", sync]
    log.clear()
    assert set(_profile_once(_FakeRunner(log), "k", [], fused=True, last=True)) == {"F", "BW"}
    assert log == [sync, "F", sync, sync, "BW", sync]
