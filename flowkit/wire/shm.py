"""How tensor bytes move between executors: shared memory on one host, chunked frames across hosts.

The design: [Note: shm], [Note: receive buffers], [Note: hosts], [Note: segment lifetime] below.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re
import socket
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from flowkit.wire.serialize import SerializeError

__all__ = ["CHUNK_BYTES", "ENV_HOST_ID", "MIN_SHM_BYTES", "PREFIX", "PeerTransport",
           "SegmentPool", "host_id", "leftover_segments", "sweep"]


# [Note: shm] `serialize.pack` turns a value into a msgpack body plus raw frames. Before a DATA
# message leaves, `PeerTransport.encode` rewrites its frame list with a `layout` (one entry per
# frame of the value):
#
# - `["shm", name, offset, nbytes, host]`: the bytes were copied into a shared-memory segment of the
#   sender, and only this handle travels. The receiver maps the segment (once; mappings are cached)
#   and builds the tensor on that mapping without a copy.
# - `k` (an int): the frame travels as k consecutive zmq frames (1 MiB each when k > 1) that the
#   receiver joins. One huge zmq frame is several times slower than many 1 MiB ones (the receiver
#   allocates and faults a fresh buffer for it), so large frames to another host are always
#   chunked: a message's bytes are bounded per zmq frame, and the receiver joins them into one
#   buffer.
#
# [Note: receive buffers] The receiver joins chunks into a buffer of its `ReceivePool`: private
# memory laid out and lent like a segment, given back to the pool by the same finalizer when the
# tensor built on it is freed. Joining into fresh memory costs its page faults, which on a virtual
# machine cost several times the copy, and a pipeline receives same-sized activations every
# microbatch. The pool keeps at most FLOWKIT_RECEIVE_POOL_BYTES (default: 1 GiB or 1/16 of
# memory); past that a join gets fresh memory.
#
# [Note: hosts] Which peers share memory is decided by host id, never by address. Every executor has
# one (`host_id()`: `--host-id`/FLOWKIT_HOST_ID when its launcher gives one, else the identity of
# the shared memory it sees: the kernel's boot id and the device of the /dev/shm mount). It tells
# the controller in its HELLO, the controller names the receiver's host id in each SEND, and the
# sender lends a segment only to a peer with its own host id; the receiver refuses a handle made on
# another. Anything else goes as chunked frames, which reach any peer, so an unknown host id ("") is
# simply another host. Not the address or the hostname: an address says nothing about memory (a
# peer at 10.0.0.7 may be this machine; containers of one machine may or may not share /dev/shm),
# and two machines may share a hostname, where a handle would name another process's segment. The
# default id is exactly "these processes see the same /dev/shm"; namespace hosts, which share it,
# are given ids of their own (flowkit/runtime/netns.py).
#
# [Note: segment lifetime] A segment belongs to the process that created it (its name is
# `flowkit-<pid>-<n>`). Its first byte says whether it is lent out: the sender sets it before
# sending the handle, and the receiver clears it when the storage built on it is freed (a finalizer
# on the buffer object that torch/numpy keep alive as long as any view of the data). The sender then
# reuses the segment, whose pages are already faulted in on both sides: a fresh buffer per transfer
# would cost more in page faults than the copy itself. No message is needed to give a segment back,
# so nothing runs on a socket from a finalizer. Names are unlinked when the owner exits (close, the
# heartbeat's exit, or the launcher's sweep after a crash); mappings alone never keep a name alive.

log = logging.getLogger("flowkit.shm")

PREFIX = "flowkit-"
SHM_DIR = "/dev/shm"
MIN_SHM_BYTES = 1 << 20  # smaller frames go inline: a handle round trip costs more than copying
CHUNK_BYTES = 1 << 20
_HEADER = 4096  # byte 0 is the lent flag; the data starts page-aligned after it
_FREE, _LENT = 0, 1
_NAME = re.compile(r"flowkit-(\d+)-(\d+)\Z")
_ENV_TRANSPORT = "FLOWKIT_PEER_TRANSPORT"  # "frames": never use shared memory (as across hosts)
_ENV_POOL = "FLOWKIT_SHM_POOL_BYTES"
_ENV_RECEIVE_POOL = "FLOWKIT_RECEIVE_POOL_BYTES"
ENV_HOST_ID = "FLOWKIT_HOST_ID"
_MAX_MAPPINGS = 64
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def host_id() -> str:
    """This process's host id [Note: hosts]: FLOWKIT_HOST_ID when a launcher gave one, else the
    identity of the shared memory this process sees (the boot and the /dev/shm mount)."""
    return os.environ.get(ENV_HOST_ID) or _shared_memory_identity()


def _shared_memory_identity() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot = file.read().strip()
    except OSError:  # not Linux: the hostname is the best guess left
        boot = socket.gethostname()
    try:
        device = os.stat(SHM_DIR).st_dev
    except OSError:
        device = 0
    return f"{boot}/{device}"


# -- sender side ---------------------------------------------------------------------------------
class _Segment:
    __slots__ = ("name", "mm", "view", "capacity")

    def __init__(self, name: str, capacity: int) -> None:
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            # Reserve the pages now: tmpfs overcommits, and a write to a page it cannot back
            # later is a SIGBUS that would kill the executor instead of an error here.
            os.posix_fallocate(fd, 0, _HEADER + capacity)
            # Pre-fault the page tables once: every later copy into the segment runs at memcpy
            # speed instead of faulting 4 KiB at a time.
            self.mm = mmap.mmap(fd, _HEADER + capacity, flags=_MAP_FLAGS)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.name, self.capacity = name, capacity
        self.view = memoryview(self.mm)[_HEADER:]

    def lent(self) -> bool:
        return self.mm[0] != _FREE

    def unlink(self) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.unlink()
        self.view.release()
        self.mm.close()


class SegmentPool:
    """The segments one process lends to its peers, reused once the peer frees what it built."""

    def __init__(self, max_bytes: int | None = None, host: str | None = None) -> None:
        self.max_bytes = _pool_limit() if max_bytes is None else max_bytes
        self.host = host or host_id()
        self.segments: list[_Segment] = []
        self._count = 0

    @property
    def total(self) -> int:
        return sum(s.capacity for s in self.segments)

    def put(self, data: memoryview) -> list | None:
        """Copy `data` into a free segment and lend it: the handle, or None if none can be had."""
        nbytes = data.nbytes
        segment = self._acquire(nbytes)
        if segment is None:
            return None
        segment.mm[0] = _LENT
        segment.view[:nbytes] = data  # one memcpy: the only copy a same-host transfer makes
        return ["shm", segment.name, _HEADER, nbytes, self.host]

    def _acquire(self, nbytes: int) -> _Segment | None:
        best = None
        for segment in self.segments:
            if segment.capacity >= nbytes and (best is None or segment.capacity < best.capacity) \
                    and not segment.lent():
                best = segment
        if best is not None:
            return best
        capacity = _capacity_for(nbytes)
        self._make_room(capacity)
        if self.total + capacity > self.max_bytes:
            return None
        self._count += 1
        try:
            segment = self._new_segment(capacity)
        except OSError as exc:  # /dev/shm full or missing: the caller sends frames instead
            log.warning("no shared-memory segment of %d bytes: %s", capacity, exc)
            return None
        self.segments.append(segment)
        return segment

    def _new_segment(self, capacity: int) -> _Segment:
        return _Segment(f"{PREFIX}{os.getpid()}-{self._count}", capacity)

    def _make_room(self, capacity: int) -> None:
        """Drop free segments, largest first, until `capacity` more fits under the limit."""
        if self.total + capacity <= self.max_bytes:
            return
        for segment in sorted(self.segments, key=lambda s: -s.capacity):
            if not segment.lent():
                self.segments.remove(segment)
                segment.close()
                if self.total + capacity <= self.max_bytes:
                    return

    def unlink_all(self) -> None:
        """Remove every name this pool created. Touches no mapping, so any thread may call it
        right before the process exits, even while the main thread copies into a segment."""
        for segment in list(self.segments):
            segment.unlink()

    def close(self) -> None:
        segments, self.segments = self.segments, []
        for segment in segments:
            segment.close()


def _capacity_for(nbytes: int) -> int:
    # Powers of two up to 64 MiB so segments fit many sizes; 16 MiB steps above, so a 300 MiB
    # tensor does not take 512 MiB.
    if nbytes <= 64 << 20:
        return max(MIN_SHM_BYTES, 1 << (nbytes - 1).bit_length())
    step = 16 << 20
    return -(-nbytes // step) * step


def _pool_limit() -> int:
    configured = os.environ.get(_ENV_POOL)
    if configured:
        return int(configured)
    try:
        stats = os.statvfs(SHM_DIR)
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0  # no /dev/shm here: every frame goes over the socket
    # tmpfs pages are RAM: several executors on one host share it with everything else
    return min(16 << 30, stats.f_bavail * stats.f_frsize // 2, memory // 4)


# -- receiver side -------------------------------------------------------------------------------
class _Buffer(_Segment):
    """Private memory laid out as a segment (byte 0 the lent flag), for frames from another
    host: pooled like segments, so a transfer lands in pages faulted in already."""

    def __init__(self, capacity: int) -> None:  # not super's: that makes a file in /dev/shm
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self.mm = mmap.mmap(-1, _HEADER + capacity, flags=flags)
        self.name, self.capacity = "", capacity
        self.view = memoryview(self.mm)[_HEADER:]

    def unlink(self) -> None:
        pass

    def close(self) -> None:
        self.view.release()
        try:
            self.mm.close()
        except BufferError:
            # still lent (a tensor of this process is built on it), or its last view is being
            # freed on another thread: the mapping goes when that view does
            pass


class ReceivePool(SegmentPool):
    """Where chunked frames from another host are joined [Note: receive buffers]."""

    def __init__(self, max_bytes: int | None = None) -> None:
        super().__init__(_receive_limit() if max_bytes is None else max_bytes, host="private")

    def join(self, parts: list) -> memoryview:
        views = [_bytes_of(part) for part in parts]
        nbytes = sum(view.nbytes for view in views)
        buffer = self._acquire(nbytes) if nbytes >= MIN_SHM_BYTES else None
        if buffer is None:
            return _join(views)
        buffer.mm[0] = _LENT
        position = 0
        for view in views:
            buffer.view[position:position + view.nbytes] = view
            position += view.nbytes
        return _lend(buffer.mm, _HEADER, nbytes)

    def _new_segment(self, capacity: int) -> _Segment:
        return _Buffer(capacity)


def _receive_limit() -> int:
    configured = os.environ.get(_ENV_RECEIVE_POOL)
    if configured:
        return int(configured)
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 256 << 20
    return min(1 << 30, memory // 16)


def _lend(mm: mmap.mmap, offset: int, nbytes: int) -> memoryview:
    """A view of `nbytes` of `mm` whose death (the last tensor built on it freed) marks the
    mapping free again [Note: segment lifetime]."""
    buffer = (ctypes.c_char * nbytes).from_buffer(mm, offset)
    buffer._flowkit_release = _Release(mm)
    return memoryview(buffer).cast("B")


class _Release:
    """Owned by the buffer a received tensor is built on: when torch or numpy frees the last view
    of that storage, this object dies with the buffer and gives the segment back to the sender."""

    __slots__ = ("mm",)

    def __init__(self, mm: mmap.mmap) -> None:
        self.mm = mm

    def __del__(self) -> None:
        try:
            self.mm[0] = _FREE
        except (ValueError, IndexError):  # mapping already closed: nothing left to give back
            pass


class MappingCache:
    """The receiver's mappings of peers' segments, kept so a reused segment costs no new mmap
    and no page faults. A mapping outlives the segment's name harmlessly; evicting one only drops
    the cache's reference (tensors still built on it keep it mapped)."""

    def __init__(self, host: str | None = None) -> None:
        self.host = host or host_id()
        self.maps: OrderedDict[str, mmap.mmap] = OrderedDict()

    def open(self, handle: Any) -> memoryview:
        name, offset, nbytes = _check_handle(handle, self.host)
        mm = self._map(name)
        if offset < _HEADER or offset + nbytes > len(mm):
            raise SerializeError(f"shared-memory handle reaches past segment {name!r} "
                                 f"({offset} + {nbytes} > {len(mm)} bytes)")
        if mm[0] != _LENT:
            raise SerializeError(f"segment {name!r} is not lent out: a stale or forged handle")
        return _lend(mm, offset, nbytes)

    def _map(self, name: str) -> mmap.mmap:
        mm = self.maps.get(name)
        if mm is not None:
            self.maps.move_to_end(name)
            return mm
        self._forget_unlinked()
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise SerializeError(f"cannot open shared-memory segment {name!r}: {exc}") from None
        try:
            size = os.fstat(fd).st_size
            if size <= _HEADER:
                raise SerializeError(f"shared-memory segment {name!r} is truncated ({size} bytes)")
            mm = mmap.mmap(fd, size, flags=_MAP_FLAGS)
        finally:
            os.close(fd)
        self.maps[name] = mm
        while len(self.maps) > _MAX_MAPPINGS:
            self.maps.popitem(last=False)
        return mm

    def _forget_unlinked(self) -> None:
        # Segments a sender dropped (or a dead sender's) would stay mapped, and their memory
        # allocated, for as long as the cache holds them: drop those whose name is gone.
        for name in [n for n in self.maps if not os.path.exists(os.path.join(SHM_DIR, n))]:
            del self.maps[name]

    def clear(self) -> None:
        self.maps.clear()


def _check_handle(handle: Any, host: str) -> tuple[str, int, int]:
    if not (isinstance(handle, list) and len(handle) == 5 and handle[0] == "shm"):
        raise SerializeError(f"malformed shared-memory handle {handle!r:.200}")
    _, name, offset, nbytes, owner_host = handle
    if not isinstance(name, str) or not _NAME.match(name):
        raise SerializeError(f"{name!r:.100} is not a flowkit shared-memory segment name")
    if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0:
        raise SerializeError(f"bad offset or size in shared-memory handle {handle!r:.200}")
    if owner_host != host:
        raise SerializeError(f"shared-memory segment {name!r} is on host {owner_host!r}, "
                             f"not on this one ({host!r})")
    return name, offset, nbytes


# -- both sides ----------------------------------------------------------------------------------
class PeerTransport:
    """One executor's data plane to its peers: a segment pool for what it sends, a mapping cache
    for what it receives, and the choice between shared memory and chunked frames per peer: shared
    memory exactly when the peer's host id is this process's [Note: hosts]."""

    def __init__(self, *, host: str | None = None, force_frames: bool | None = None) -> None:
        if force_frames is None:
            force_frames = os.environ.get(_ENV_TRANSPORT, "auto") == "frames"
        self.force_frames = force_frames or not os.path.isdir(SHM_DIR)
        self.host = host or host_id()
        self.pool = SegmentPool(host=self.host)
        self.maps = MappingCache(host=self.host)
        self.received = ReceivePool()

    def encode(self, body: bytes, frames: list, peer_host_id: str) -> tuple[dict, list]:
        """(meta, wire frames) of a DATA message carrying the packed value to a peer on host
        `peer_host_id`."""
        if not frames:
            return {"body": body}, frames
        local = self.is_local(peer_host_id)
        layout, wire = [], []
        for frame in frames:
            data = frame if isinstance(frame, memoryview) else memoryview(frame)
            if data.format != "B" or data.ndim != 1:
                data = data.cast("B")
            size = data.nbytes
            handle = self.pool.put(data) if local and size >= MIN_SHM_BYTES else None
            if handle is not None:
                layout.append(handle)
            elif size > CHUNK_BYTES:
                pieces = [data[i:i + CHUNK_BYTES] for i in range(0, size, CHUNK_BYTES)]
                layout.append(len(pieces))
                wire += pieces
            else:
                layout.append(1)
                wire.append(frame)
        return {"body": body, "layout": layout}, wire

    def decode(self, meta: dict, wire: list) -> list:
        """The value's frames from a DATA message's wire frames and layout; SerializeError for a
        layout that does not match what arrived (a truncated or forged message)."""
        layout = meta.get("layout")
        if layout is None:
            return wire
        if not isinstance(layout, list):
            raise SerializeError(f"frame layout must be a list, got {type(layout).__name__}")
        frames, position = [], 0
        for entry in layout:
            if type(entry) is int:
                if entry < 1 or position + entry > len(wire):
                    raise SerializeError(f"frame layout wants {entry} more frames at frame "
                                         f"{position}, the message has {len(wire)} (truncated?)")
                parts = wire[position:position + entry]
                position += entry
                frames.append(parts[0] if entry == 1 else self.received.join(parts))
            else:
                frames.append(self.maps.open(entry))
        if position != len(wire):
            raise SerializeError(f"message has {len(wire)} frames, its layout names {position}")
        return frames

    def is_local(self, peer_host_id: str) -> bool:
        """Whether a peer on host `peer_host_id` maps this process's segments. An unknown host
        ("") is another: frames reach any peer, a handle only one that shares /dev/shm."""
        return not self.force_frames and peer_host_id == self.host

    def unlink_all(self) -> None:
        self.pool.unlink_all()

    def close(self) -> None:
        self.pool.close()
        self.received.close()
        self.maps.clear()


def _bytes_of(part: Any) -> memoryview:
    view = part.buffer if hasattr(part, "buffer") else memoryview(part)  # a zmq.Frame or bytes
    return view.cast("B") if view.format != "B" else view


def _join(views: list[memoryview]) -> memoryview:
    joined = bytearray(sum(v.nbytes for v in views))
    out, position = memoryview(joined), 0
    for view in views:
        out[position:position + view.nbytes] = view
        position += view.nbytes
    return out


# -- sweeping after processes that could not clean up -------------------------------------------
def leftover_segments(pids: Iterable[int] | None = None) -> list[str]:
    """Names of flowkit segments in /dev/shm (of these pids, or all)."""
    wanted = None if pids is None else {str(p) for p in pids}
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    found = []
    for name in names:
        match = _NAME.match(name)
        if match and (wanted is None or match.group(1) in wanted):
            found.append(name)
    return sorted(found)


def sweep_stale() -> list[str]:
    """Unlink the segments in /dev/shm of processes that no longer run and that are this
    user's: what executors killed together with their controller (no launcher left to sweep
    after them) left behind. Run when a run starts its executors; a live process's segments,
    and other users', are kept. Returns what was removed."""
    removed = []
    for name in leftover_segments():
        path = os.path.join(SHM_DIR, name)
        pid = int(_NAME.match(name).group(1))
        try:
            owner = os.lstat(path).st_uid
        except OSError:
            continue
        if owner != os.getuid() or _running(pid):
            continue
        try:
            os.unlink(path)
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def _running(pid: int) -> bool:
    """Whether a process of this pid exists and is not a zombie (a reused pid counts: its
    segments are kept)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except OverflowError:
        return False
    try:  # a zombie (killed, not yet reaped by whoever adopted it) uses no segment again
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def sweep(pids: Iterable[int]) -> list[str]:
    """Unlink the segments of these (exited) processes; a SIGKILLed executor leaves its segments
    behind, and only its launcher knows it is gone. Returns what was removed."""
    removed = []
    for name in leftover_segments(pids):
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed
