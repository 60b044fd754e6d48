"""Weights from a trainer to a generator on the same GPU without the host: one device buffer
handed over through CUDA IPC [Note: weights on one GPU].
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
from collections.abc import Sequence
from typing import Any

import torch

from executors.torch import weights
from executors.torch.errors import StageError
from flowkit.ops.records import SharedWeights

__all__ = ["checked_places", "gpu_uuid", "opened", "share"]

# [Note: weights on one GPU] Executors that share a GPU (`--device cuda:0`: a trainer and a
# generator) would sync weights through the host: a copy down, the data plane, a copy up. So
# the export copies the stage's parameters into one device buffer (a snapshot: the trainer's
# next step cannot tear a load still reading it) and sends its CUDA IPC handle (a SharedWeights
# record, bytes not gigabytes); each reader copies from it into its own weights, device to
# device. The buffer is shared once per reader (its own reference counter and event), then
# dropped: torch's IPC reference counting keeps the block until every reader has released it.
# A reader in the exporting process takes the buffer itself. The price: a second copy of the
# stage on the GPU until its readers have loaded it. The runner asks for this only
# where every executor reports the same GPU (`resources["gpu"]`, executors/settings.py); the
# reader checks the GPU's UUID and every field before it opens anything; `--weight-sync host`
# keeps the host path. On an H200, 1.0 GB: shared in 1.5-2.8 ms and loaded by another process
# in 1.9-2.9 ms, against 38 ms through one pinned host buffer in one process (`bash
# tools/gpu/device_check.sh`, weights_ipc).

_HANDLE_BYTES = 64  # CUDA_IPC_HANDLE_SIZE: a memory or an event handle
_COUNTER_SLOTS = 10_000  # CUDA_IPC_REF_COUNTER_FILE_SIZE: the slots of one counter file
# a counter file's name as torch makes it (NewProcessWideShmHandle: /torch_PID_RANDOM_COUNT)
_COUNTER_FILE = re.compile(r"/torch_([0-9]{1,10})_[0-9]{1,20}_[0-9]{1,20}")
_MAX_BYTES = weights.MAX_PACKED_BYTES
_KEPT = 2  # buffers of one stage kept for a reader in this process: the newest and one before
_PROCESS = secrets.token_hex(8)  # this process, as no pid says it (pids repeat in namespaces)
_keys = itertools.count()
_kept: dict[str, dict[int, torch.Tensor]] = {}  # a stage's exports kept, by export key


def gpu_uuid(device: torch.device) -> str:
    """The UUID of the GPU `device` is (the same in every process, whatever it calls it)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def share(params: Sequence[torch.Tensor], named: Sequence[tuple[str, int]],
          readers: Sequence[str], own_name: str, *, slot: str = "") -> SharedWeights:
    """`params` (on one GPU) copied into one device buffer, shared with each of `readers`
    (executor names) [Note: weights on one GPU]; `named`: each unsplit name and the index of
    its parameter (weights.exported); `slot`: the stage it is (what a reader here keeps, it
    keeps for each stage apart)."""
    device = params[0].device
    remote = [reader for reader in readers if reader != own_name]
    if remote and device.type != "cuda":
        raise StageError(f"weights on {device} cannot be shared with executors {remote}: "
                         "only a GPU's are, through CUDA IPC")
    flat, entries = weights.packed_copy(params, named)
    key = next(_keys)
    storage = flat.untyped_storage()
    handle, size, offset, counters = b"", flat.numel(), 0, {}
    for reader in readers:
        if reader == own_name:
            counters[reader] = None
            continue
        _, handle, size, offset, counter, slot, event, wait = storage._share_cuda_()
        counters[reader] = [counter.decode(), int(slot), bytes(event), bool(wait)]
    if own_name in readers:
        kept = _kept.setdefault(slot, {})
        kept[key] = flat
        for old in sorted(kept)[:-_KEPT]:
            del kept[old]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.ipc_collect()  # blocks of earlier exports whose readers all released them
    return SharedWeights(
        gpu=gpu_uuid(device) if cuda else str(device), pid=os.getpid(), process=_PROCESS,
        key=key,
        handle=bytes(handle), size=int(size), offset=int(offset), readers=counters,
        tensors=entries)


def opened(shared: SharedWeights, reader: str, device: torch.device) -> dict[str, torch.Tensor]:
    """The weights `shared` hands `reader` (this executor), by unsplit name: views of the
    exporter's buffer on `device`, released when they are dropped."""
    places = checked_places(shared, reader)
    if shared.process == _PROCESS:
        flat = next((kept.pop(shared.key) for kept in _kept.values() if shared.key in kept),
                    None)
        if flat is None:
            raise StageError(f"export {shared.key} of this executor's weights is no longer "
                             f"kept (only a stage's last {_KEPT} are): load each export as "
                             "it comes")
    else:
        flat = _opened_buffer(shared, reader, device)
    views = weights.packed_views(flat, [place for _, place in places])
    return {name: view for (name, _), view in zip(places, views)}


def _opened_buffer(shared: SharedWeights, reader: str, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        raise StageError(f"executor {reader!r} holds the model on {device}, so it cannot open "
                         "weights shared on a GPU; give --weight-sync host to sync through "
                         "the host")
    own = gpu_uuid(device)
    if own != shared.gpu:
        raise StageError(f"weights shared on GPU {shared.gpu[:64]} cannot be opened by executor "
                         f"{reader!r} on GPU {own}: executors that report one GPU must be on "
                         "one; give --weight-sync host to sync through the host")
    counter, slot, event, wait = shared.readers[reader]
    index = device.index if device.index is not None else torch.cuda.current_device()
    storage = torch.UntypedStorage._new_shared_cuda(
        index, shared.handle, shared.size, shared.offset, counter.encode(), slot, event, wait)
    return torch.empty(0, dtype=torch.uint8, device=device).set_(
        storage, 0, (shared.size,), (1,))


def checked_places(shared: Any, reader: str) -> list[tuple[str, tuple[torch.dtype, list, int]]]:
    """Each tensor of `shared` as (unsplit name, (dtype, shape, byte offset)), once every field
    a reader relies on is checked: it came over the wire [Note: weights on one GPU]."""
    if not isinstance(shared, SharedWeights):
        raise StageError(f"expected SharedWeights, got a {type(shared).__name__}")

    def bad(what: str) -> StageError:
        return StageError(f"shared weights (export {str(shared.key)[:20]}): {what}; refusing "
                          "to open them")

    if type(shared.gpu) is not str or len(shared.gpu) > 64:
        raise bad("the GPU must be a UUID string")
    if type(shared.pid) is not int or shared.pid <= 0 or type(shared.key) is not int \
            or type(shared.process) is not str or len(shared.process) > 64:
        raise bad("pid and key must be positive integers, the process a short name")
    if type(shared.size) is not int or not 0 < shared.size <= _MAX_BYTES:
        raise bad(f"the buffer's size must be 1..{_MAX_BYTES} bytes")
    if type(shared.offset) is not int or not 0 <= shared.offset <= _MAX_BYTES:
        raise bad(f"the buffer's offset must be 0..{_MAX_BYTES}")
    if type(shared.readers) is not dict or reader not in shared.readers:
        raise bad(f"executor {reader!r} is not one of its readers")
    if shared.process != _PROCESS:
        _check_handle(shared.handle, shared.readers[reader], shared.pid, bad)
    return weights.checked_places(shared.tensors, shared.size, bad)


def _check_handle(handle: Any, entry: Any, pid: int, bad) -> None:
    # torch's caching allocator names a block by a version byte, a type byte and the handle:
    # "c" and cudaIpcMemHandle's 64 bytes (torch before the versions: the 64 bytes alone). An
    # expandable segment's ("e") has a process's file descriptors fetched by its pid, which a
    # peer's record could point anywhere: refused
    version = handle[0] if type(handle) is bytes and handle else 0
    kind = handle[1:2] if 0 < version < 16 else b""
    if kind == b"e":
        raise bad("its memory is an expandable segment's (PYTORCH_CUDA_ALLOC_CONF "
                  "expandable_segments:True on the exporter), whose handle names a process; "
                  "give --weight-sync host, or run without expandable segments")
    if not (type(handle) is bytes and (len(handle) == _HANDLE_BYTES
                                       or kind == b"c" and len(handle) == 2 + _HANDLE_BYTES)):
        raise bad(f"the memory handle must be torch's: a version, b'c' and {_HANDLE_BYTES} "
                  "bytes")
    if not (type(entry) is list and len(entry) == 4):
        raise bad("a reader's entry must be [counter file, slot, event handle, wait]")
    counter, slot, event, wait = entry
    match = _COUNTER_FILE.fullmatch(counter) if type(counter) is str else None
    if match is None or int(match.group(1)) != pid:
        raise bad("the reference counter must be a torch counter file of the exporting process")
    if type(slot) is not int or not 0 <= slot < _COUNTER_SLOTS:
        raise bad(f"the counter's slot must be 0..{_COUNTER_SLOTS - 1}")
    if type(event) is not bytes or len(event) != _HANDLE_BYTES or type(wait) is not bool:
        raise bad(f"the event handle must be {_HANDLE_BYTES} bytes and its wait a bool")
