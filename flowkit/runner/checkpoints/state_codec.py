"""The codec of the controller's part of a run checkpoint: plain values in msgpack, with the record,
tensor and array extension types built here, never pickle [Note: run state on disk]; and the
private files it is written to. What the state holds and its schema: controller_state.py.

[Note: run state on disk] `--resume` reads a file that anyone who could write the checkpoint
folder may have crafted, so reading it must run no code: the file is msgpack of None, bool, int,
float, str, bytes, lists and maps, plus four extension types this module builds itself: a tuple,
a tensor and a numpy array (dtype from a fixed list, shape, raw bytes), and a record (an attrs
class named by path). A record's class is looked up in the records this run allows (those of the
declared op contract, flowkit/ops/records.py, and those the flow's ports carry, with their
subclasses already loaded), never imported; an unknown name is an error. Every field of the state
is checked for its type and bounds before anything is built from it, and any problem is one
CheckpointError naming the file and the field. A model's build and config are not part of it:
a resumed training rebuilds them from the flow (model_training.ModelTraining.restore_carried).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
import msgpack

from flowkit.ops import records as contract_records
from flowkit.wire.files import FileRefused, read_regular
from flowkit.wire.serialize import TORCH_DTYPES

__all__ = ["CheckpointError", "STATE_FORMAT", "allowed_records", "decode_state", "encode_state",
           "read_private", "reason", "short",
           "write_private"]

STATE_FORMAT = "flowkit.run_state/1"

_TUPLE, _RECORD, _TENSOR, _NDARRAY = 1, 2, 3, 4
_MAX_FILE = 1 << 36  # 64 GiB: far past any real state, and a bound on what a read allocates
_NUMPY_KINDS = frozenset("biufc")  # no object arrays: their items would be unpickled


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, read or resumed from; the message names why."""


# -- private files -----------------------------------------------------------------------------
def write_private(path: Path, data: bytes) -> None:
    """Write `path` as a new file only its owner can read (0600 whatever the umask), synced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb", closefd=False) as file:
            file.write(data)
            file.flush()
            os.fsync(fd)
    finally:
        os.close(fd)


def read_private(path: Path, what: str, limit: int = _MAX_FILE, sha256: str | None = None
                 ) -> bytearray:
    """The bytes of regular file `path` [Note: contained files in flowkit/wire/files.py]; a
    CheckpointError naming it when it is a symlink, not a regular file, over `limit` bytes,
    unreadable, or (given its `sha256`) not the file that was written."""
    try:
        data = read_regular(path, limit=limit)
        if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
            raise FileRefused(f"{path} does not match its SHA-256 in manifest.json: it "
                              "changed after it was written")
        return data
    except FileRefused as exc:
        raise CheckpointError(f"{what}: {exc}") from None


# -- the records a run allows ------------------------------------------------------------------
def allowed_records(flow: Any = None) -> dict[str, type]:
    """Record classes by path: the declared op contract's, and those `flow`'s ports carry,
    each with its subclasses loaded in this process (a Scored where a Rollout is declared)."""
    roots = [getattr(contract_records, name) for name in contract_records.__all__]
    if flow is not None:
        roots += list(_port_items(flow))
    found: dict[str, type] = {}
    todo = [cls for cls in roots if isinstance(cls, type) and attrs.has(cls)]
    while todo:
        cls = todo.pop()
        path = _path_of(cls)
        if path not in found:
            found[path] = cls
            todo += [sub for sub in cls.__subclasses__() if attrs.has(sub)]
    return found


def _port_items(flow: Any) -> Iterable[Any]:
    for node in flow.nodes.values():
        operator = node.operator
        yield from (ptype.item for ptype in operator.outputs.values())
        yield from (port.type.item for port in operator.inputs.values())
    yield from (fb.type.item for fb in flow.feedbacks.values())


def _path_of(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


# -- encoding ----------------------------------------------------------------------------------
def encode_state(state: Mapping[str, Any]) -> bytes:
    """msgpack of `state` (plain values, tuples, attrs records, tensors, numpy arrays)."""
    return msgpack.packb({"format": STATE_FORMAT, **state}, default=_default,
                         use_bin_type=True, strict_types=True)


def _default(obj: Any) -> msgpack.ExtType:
    if isinstance(obj, tuple):
        return msgpack.ExtType(_TUPLE, _pack(list(obj)))
    if attrs.has(type(obj)):
        fields = {f.name: getattr(obj, f.name) for f in attrs.fields(type(obj)) if f.init}
        return msgpack.ExtType(_RECORD, _pack([_path_of(type(obj)), fields]))
    module = type(obj).__module__
    if module.startswith("torch") and type(obj).__name__ in ("Tensor", "Parameter"):
        tensor = obj.detach().cpu().contiguous()
        data = tensor.view(-1).view(_torch().uint8).numpy().tobytes() if tensor.numel() else b""
        meta = [str(tensor.dtype).removeprefix("torch."), list(tensor.shape), data]
        return msgpack.ExtType(_TENSOR, _pack(meta))
    if module == "numpy" and hasattr(obj, "__array_interface__"):
        import numpy

        array = numpy.ascontiguousarray(obj)
        return msgpack.ExtType(_NDARRAY, _pack([array.dtype.str, list(array.shape),
                                                array.tobytes()]))
    for base in (bool, int, float, str, bytes):  # a subclass (an IntEnum, a str enum): its value
        if isinstance(obj, base):
            return base(obj)
    raise CheckpointError(f"a checkpoint holds plain values, records, tensors and arrays, "
                          f"not a {type(obj).__qualname__}")


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, default=_default, use_bin_type=True, strict_types=True)


def _torch() -> Any:
    import torch

    return torch


# -- decoding ----------------------------------------------------------------------------------
def decode_state(data: bytes, path: Path, records: Mapping[str, type]) -> dict:
    """The state in `data` (the bytes of `path`), its values rebuilt; a CheckpointError of one
    line naming `path` when it is not one this flowkit wrote."""
    hook = _Decoder(records).ext_hook
    try:
        state = msgpack.unpackb(data, ext_hook=hook, raw=False, strict_map_key=False,
                                use_list=True)
    except CheckpointError as exc:
        raise CheckpointError(f"--resume: {path}: {exc}") from None
    except Exception as exc:  # truncated, not msgpack, too deep: never a traceback
        raise CheckpointError(f"--resume: {path}: not a run state ({reason(exc)})") from None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"--resume: {path}: not a run state of this flowkit "
                              f"({STATE_FORMAT!r}, found {short(found)})")
    return state


def reason(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


class _Decoder:
    __slots__ = ("records",)

    def __init__(self, records: Mapping[str, type]) -> None:
        self.records = records

    def ext_hook(self, code: int, data: bytes) -> Any:
        payload = msgpack.unpackb(data, ext_hook=self.ext_hook, raw=False, strict_map_key=False)
        if code == _TUPLE:
            return tuple(_list(payload, "a tuple"))
        if code == _RECORD:
            return self._record(payload)
        if code == _TENSOR:
            return _tensor(payload)
        if code == _NDARRAY:
            return _ndarray(payload)
        raise CheckpointError(f"unknown extension type {code}")

    def _record(self, payload: Any) -> Any:
        if not (isinstance(payload, list) and len(payload) == 2 and isinstance(payload[0], str)
                and isinstance(payload[1], dict)):
            raise CheckpointError("a record that is not [class, fields]")
        path, fields = payload
        cls = self.records.get(path)
        if cls is None:
            raise CheckpointError(f"record class {path[:200]!r} is not one this flow uses; "
                                  "nothing is imported from a checkpoint")
        names = {f.name for f in attrs.fields(cls) if f.init}
        unknown = sorted(set(map(str, fields)) - names)
        if unknown:
            raise CheckpointError(f"record {path} has no field(s) {unknown[:5]}")
        try:
            return cls(**fields)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"record {path}: {reason(exc)}") from None


def _shape(value: Any, what: str) -> list[int]:
    dims = _list(value, f"{what} shape")
    if len(dims) > 16 or not all(isinstance(d, int) and not isinstance(d, bool) and
                                 0 <= d < _MAX_FILE for d in dims):
        raise CheckpointError(f"{what} of shape {dims[:17]!r}: not a shape")
    return dims


def _tensor(payload: Any) -> Any:
    dtype_name, shape, data = _triple(payload, "a tensor")
    if type(dtype_name) is not str or dtype_name not in TORCH_DTYPES:
        raise CheckpointError(f"a tensor of dtype {str(dtype_name)[:40]!r}")
    torch = _torch()
    dtype, dims = getattr(torch, dtype_name), _shape(shape, "a tensor")
    if len(data) != math.prod(dims) * dtype.itemsize:
        raise CheckpointError(f"a tensor of shape {dims} and dtype {dtype_name} with "
                              f"{len(data)} bytes")
    if not data:
        return torch.empty(dims, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(dims)


def _ndarray(payload: Any) -> Any:
    import numpy

    dtype_name, shape, data = _triple(payload, "an array")
    try:
        dtype = numpy.dtype(str(dtype_name))
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in _NUMPY_KINDS or dtype.fields is not None:
        raise CheckpointError(f"an array of dtype {str(dtype_name)[:40]!r}")
    dims = _shape(shape, "an array")
    if len(data) != math.prod(dims) * dtype.itemsize:
        raise CheckpointError(f"an array of shape {dims} with {len(data)} bytes")
    return numpy.frombuffer(bytearray(data), dtype=dtype).reshape(dims)


def _triple(payload: Any, what: str) -> tuple[Any, Any, bytes]:
    if not (isinstance(payload, list) and len(payload) == 3 and isinstance(payload[2], bytes)):
        raise CheckpointError(f"{what} that is not [dtype, shape, bytes]")
    return payload[0], payload[1], payload[2]


def _list(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise CheckpointError(f"{what} that is a {type(value).__name__}, not a list")
    return value


def short(value: Any) -> str:
    """`value`'s repr, cut to a line's part: what an error message quotes of a bad field."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."
