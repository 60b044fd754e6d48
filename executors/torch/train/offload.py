"""A microbatch's stashed activations moved to host memory after its forward and back before its
backward: the executor's side of the planner's O and P actions [Note: offload in
flowkit/planner/offload.py].

[Note: offloaded stash] An offloading forward runs under `HostStash`'s saved-tensor hooks: each
tensor autograd saves is packed as a reference to its storage (a view's offset, size and stride
beside it), so tensors that share a storage move as one copy and come back as views of one
storage. The deferred calls' tensors (what W needs [Note: deferred weight gradients in
executors/torch/train/deferred.py]) move with them. Parameters, buffers and the stage's inputs
and outputs stay: B differentiates with respect to those very tensors. `offload()` copies every
storage to host memory and drops the device's reference: on CUDA into pinned memory,
non-blocking on a side stream that first waits for the compute stream, the device blocks kept
until the copy is done (`record_stream`); on CPU a plain copy, so `device_bytes` shows the
mechanism. `prefetch()` copies back, on the side stream on CUDA; `wait()` makes the compute
stream wait for it and is called by the backward itself, so a backward with no prefetch still
finds its activations. In full: docs/schedules.md, "Offload in a flow run".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs
import torch

__all__ = ["HostStash"]


@attrs.define(eq=False)
class _Storage:
    """One device storage of a stash: on the device (`device`), on the host (`host`), or coming
    back (`device` set and `ready` the event to wait for)."""

    device: torch.UntypedStorage | None
    nbytes: int
    host: torch.Tensor | None = None  # uint8, pinned on CUDA
    ready: Any = None  # a torch.cuda.Event while a copy back runs


@attrs.frozen(eq=False)
class _Ref:
    """What a saved tensor is packed as: its storage and how to view it again."""

    storage: _Storage
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    device: torch.device

    def tensor(self) -> torch.Tensor:
        if self.storage.device is None:
            raise RuntimeError("an offloaded activation was read before its prefetch")
        out = torch.empty(0, dtype=self.dtype, device=self.device)
        return out.set_(self.storage.device, self.offset, self.size, self.stride)


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class HostStash:
    """A context manager active during an offloading forward: packs what autograd saves as
    movable references [Note: offloaded stash]; `saved` notes every storage's bytes as
    `SavedBytes` does. The hooks object lives only for the forward: held by the stash, its
    bound methods would make a cycle that keeps the device memory until a garbage collection."""

    def __init__(self, params: Iterable[torch.Tensor], keep: Iterable[torch.Tensor],
                 device: torch.device) -> None:
        self.device = device
        self.saved: dict[int, int] = {}
        self.storages: dict[int, _Storage] = {}
        self.resident: dict[int, int] = {}  # saved storages that stay: buffers, inputs, outputs
        self._params = {t.untyped_storage().data_ptr() for t in params}
        self._keep = {t.untyped_storage().data_ptr() for t in keep}
        self._moved: list[tuple[Any, str, _Ref]] = []  # (object, attribute, ref) to restore
        self.offloaded = False
        self._hooks: Any = None

    def __enter__(self) -> HostStash:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(*exc)

    # -- hooks ----------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._params:
            return t
        self.saved[key] = storage.nbytes()
        if key in self._keep or t.device != self.device:
            self.resident[key] = storage.nbytes()
            return t
        return self._ref(t)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor() if isinstance(packed, _Ref) else packed

    def _ref(self, t: torch.Tensor) -> _Ref:
        storage = t.untyped_storage()
        held = self.storages.setdefault(storage.data_ptr(), _Storage(storage, storage.nbytes()))
        return _Ref(held, t.dtype, t.storage_offset(), tuple(t.size()), tuple(t.stride()),
                    t.device)

    # -- moving ---------------------------------------------------------------------------
    def keep(self, tensors: Iterable[torch.Tensor]) -> None:
        """Storages that must stay on the device (the stage's inputs and outputs)."""
        self._keep.update(t.untyped_storage().data_ptr() for t in tensors)
        for key in list(self.storages):
            if key in self._keep:  # packed before they were known: stay, never copied
                self.resident[key] = self.storages.pop(key).nbytes

    def offload(self, holders: Iterable[tuple[Any, str]]) -> None:
        """Copy every storage to host memory and drop the device's; `holders` are (object,
        attribute) pairs of other tensors that move too (the deferred calls' X)."""
        if self.offloaded:
            return
        for obj, name in holders:
            t = getattr(obj, name)
            if not (isinstance(t, torch.Tensor) and t.device == self.device) or \
                    t.untyped_storage().data_ptr() in self._keep:
                continue
            if name == "x" and t._version != obj.x_version:
                raise RuntimeError(
                    "the input of a linear, layer_norm or embedding layer was modified in place "
                    "after the forward; deferred weight gradients need it unchanged (use an "
                    "out-of-place op in the model)")
            self._moved.append((obj, name, self._ref(t)))
            setattr(obj, name, None)
        cuda = self.device.type == "cuda"
        stream = _side_stream(self.device) if cuda else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else _nothing():
            for held in self.storages.values():
                source = _bytes_of(held.device, self.device)
                held.host = torch.empty(held.nbytes, dtype=torch.uint8, pin_memory=cuda)
                held.host.copy_(source, non_blocking=cuda)
                if stream is not None:
                    source.record_stream(stream)
                held.device = None
        self.offloaded = True

    def prefetch(self) -> None:
        """Start copying every storage back to the device."""
        if not self.offloaded:
            return
        cuda = self.device.type == "cuda"
        stream = _side_stream(self.device) if cuda else None
        if stream is not None:  # its new blocks may be ones the compute stream has just freed
            stream.wait_stream(torch.cuda.current_stream(self.device))
        for held in self.storages.values():
            target = torch.empty(held.nbytes, dtype=torch.uint8, device=self.device)
            if stream is not None:
                with torch.cuda.stream(stream):
                    target.copy_(held.host, non_blocking=True)
                    target.record_stream(stream)
                    held.ready = torch.cuda.Event()
                    held.ready.record(stream)
            else:
                target.copy_(held.host)
            held.device, held.host = target.untyped_storage(), None
        for obj, name, ref in self._moved:
            tensor = ref.tensor()
            setattr(obj, name, tensor)
            if hasattr(obj, "x_version") and name == "x":
                obj.x_version = tensor._version  # a fresh tensor: edits count from here
        self._moved.clear()
        self.offloaded = False

    def wait(self) -> None:
        """Before the backward reads them: bring them back if no prefetch did, and on CUDA make
        the compute stream wait for the copies."""
        self.prefetch()
        for held in self.storages.values():
            if held.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(held.ready)
                held.ready = None

    def device_storages(self) -> dict[int, int]:
        """{address: bytes} of the saved storages on the device now."""
        return {**self.resident, **{held.device.data_ptr(): held.nbytes
                                    for held in self.storages.values()
                                    if held.device is not None}}


_STREAMS: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: Any) -> None:
        return None
