"""Values on the wire without pickle: msgpack for plain data, raw frames for tensor bytes.

`pack(value)` walks any nesting of None, bool, int, float, str, bytes, list, tuple, dict, attrs
records, torch tensors and numpy arrays. Tensors travel out of band: their bytes become separate
zmq frames (zero-copy on the sending side) and the body holds dtype, shape and a frame index.
Records travel as their class path and fields; the receiver rebuilds them only from a class it
already declares [Note: record registry], so a message can never make the receiver import a
module or call arbitrary code.

[Note: records inline] A record is a map of its fields with one more key, an empty extension of
type 5 whose value is the class path: one msgpack pass packs or decodes it, and a hook on maps
builds the record from the map that holds that key. The key decodes to a marker no other value
decodes to; a body in which one is left anywhere else (a list item, a field's value) is refused.
Records used to travel as an extension holding their own msgpack body (type 3, still read),
each packed by a msgpack call of its own (`flowkit bench codec` measures both forms).
"""

from __future__ import annotations

import ctypes
import importlib
import sys
import warnings
from typing import Any

import attrs
import msgpack

from flowkit.wire.collection import COLLECTOR_PAUSE

__all__ = ["CONTRACT_MODULES", "TORCH_DTYPES", "SerializeError", "allow_records",
           "declare_modules", "declared_modules", "nbytes_of", "pack", "unpack"]

# The dtypes a tensor may name, on the wire and in a checkpoint's run state: a name is looked
# up on `torch` only once it is one of these (any other attribute might import a submodule,
# `_inductor`'s 1,745 modules, or be a function)
TORCH_DTYPES = frozenset("bool uint8 int8 int16 int32 int64 float16 bfloat16 float32 float64 "
                         "complex64 complex128".split())

_TENSOR, _NDARRAY, _RECORD, _TUPLE, _RECORD_KEY = 1, 2, 3, 4, 5
_KEY = msgpack.ExtType(_RECORD_KEY, b"")  # [Note: records inline]: its value is the class path


class _RecordKey:
    """What `_KEY` decodes to: a key no other value decodes to (hashed by identity)."""

    __slots__ = ()


_RECORD_KEY_DECODED = _RecordKey()
_LAYOUTS: dict[type, tuple[str, tuple[str, ...]]] = {}  # class -> (path, field names)
_PAUSE_GC_BYTES = 32 << 10  # bodies from this size decode with the collector paused
_MAX_EXT_DEPTH = 32  # extensions inside extensions, at most

# A received zmq frame is read-only memory that this process owns; the tensors built on it are
# views that nothing else sees, so torch's warning about writing through them does not apply.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


class SerializeError(ValueError):
    """A value that cannot travel (an unsupported type) or a body that cannot be rebuilt."""


def pack(value: Any) -> tuple[bytes, list]:
    """(msgpack body, out-of-band frames) for `value`."""
    packer = _Packer()
    return _packb(value, packer.default), packer.frames


def unpack(body: bytes, frames: list) -> Any:
    """Rebuild a value from `pack`'s output; tensors become views of the received frames."""
    # [Note: no collections while decoding] A body of a batch's records makes tens of thousands
    # of lists and records, every one a container the cycle collector tracks: it would run
    # every 700 of them and rescan what is already built and what the process holds, so that
    # decoding cost grew faster than the body (`flowkit bench codec`). What a body decodes to
    # holds no cycles: nothing is lost by collecting after it, as msgpack's documentation
    # advises for large bodies.
    # Threads decoding at once share one pause: the collector comes back when the last ends,
    # as it was when the first began.
    paused = len(body) >= _PAUSE_GC_BYTES
    if paused:
        COLLECTOR_PAUSE.enter()
    unpacker = _Unpacker(frames)
    try:
        value = _unpackb(body, unpacker)
    except SerializeError:
        raise
    except Exception as exc:
        raise SerializeError(f"cannot decode value: {exc.__class__.__name__}: {exc}") from None
    finally:
        if paused:
            COLLECTOR_PAUSE.leave()
    if unpacker.keys:  # [Note: records inline]: a record key anywhere but heading a record
        raise SerializeError("cannot decode value: a record key outside a record's map")
    return value


# The hooks are bound methods of small objects rather than closures: a closure that passes
# itself to msgpack refers to itself, a reference cycle that keeps every frame (and so every
# tensor) alive until the cycle collector happens to run.
class _Packer:
    __slots__ = ("frames",)

    def __init__(self) -> None:
        self.frames: list = []

    def default(self, obj: Any) -> Any:
        layout = _LAYOUTS.get(type(obj))  # a record of a class seen before: the common case
        if layout is not None:
            return _inline(obj, layout)
        if isinstance(obj, tuple):
            return msgpack.ExtType(_TUPLE, _packb(list(obj), self.default))
        if _is_torch_tensor(obj):
            return msgpack.ExtType(_TENSOR, _packb(_torch_meta(obj, self.frames), self.default))
        if type(obj).__module__ == "numpy" and hasattr(obj, "__array_interface__"):
            return msgpack.ExtType(_NDARRAY, _packb(_numpy_meta(obj, self.frames),
                                                    self.default))
        layout = _layout(type(obj))
        if layout is not None:
            return _inline(obj, layout)
        raise SerializeError(
            f"cannot send a {type(obj).__qualname__}: values on the wire are plain data, attrs "
            "records, torch tensors or numpy arrays"
        )


class _Unpacker:
    # keys: record keys decoded and not yet taken by their record's map (none may be left);
    # depth: extensions being decoded inside one another (each is a msgpack call of its own on
    # the C stack: a few hundred nested in a small body would crash the process)
    __slots__ = ("depth", "frames", "keys")

    def __init__(self, frames: list) -> None:
        self.frames = frames
        self.keys = 0
        self.depth = 0

    def ext_hook(self, code: int, data: bytes) -> Any:
        if code == _RECORD_KEY:
            if data:
                raise SerializeError("a record key extension carries no data")
            self.keys += 1
            return _RECORD_KEY_DECODED
        if self.depth >= _MAX_EXT_DEPTH:
            raise SerializeError(f"values nest extensions (tuples, tensors, records) more than "
                                 f"{_MAX_EXT_DEPTH} deep")
        self.depth += 1
        try:
            payload = _unpackb(data, self)
        finally:
            self.depth -= 1
        if code == _TUPLE:
            return tuple(payload)
        if code == _TENSOR:
            return _torch_from(payload, self.frames)
        if code == _NDARRAY:
            return _numpy_from(payload, self.frames)
        if code == _RECORD:
            return _record_from(*payload)
        raise SerializeError(f"unknown extension type {code} in a value")

    def object_hook(self, fields: dict) -> Any:
        path = fields.pop(_RECORD_KEY_DECODED, fields)
        if path is fields:
            return fields
        self.keys -= 1
        return _record_from(path, fields)


def nbytes_of(frames: list) -> int:
    return sum(memoryview(f).nbytes if not hasattr(f, "nbytes") else f.nbytes for f in frames)


def _packb(value: Any, default) -> bytes:
    # tuples go through `default` (strict_types) so they come back as tuples, not lists
    return msgpack.packb(value, default=default, use_bin_type=True, strict_types=True)


def _unpackb(data: bytes, unpacker: _Unpacker) -> Any:
    return msgpack.unpackb(data, ext_hook=unpacker.ext_hook, object_hook=unpacker.object_hook,
                           raw=False, strict_map_key=False)


def _inline(record: Any, layout: tuple[str, tuple[str, ...]]) -> dict:
    """A record as the map of its fields and its class path [Note: records inline]."""
    path, names = layout
    fields: dict = {_KEY: path}
    for name in names:
        fields[name] = getattr(record, name)
    return fields


def _layout(cls: type) -> tuple[str, tuple[str, ...]] | None:
    """An attrs class's path and field names, kept; None for any other class."""
    if not attrs.has(cls):
        return None
    layout = _LAYOUTS[cls] = (f"{cls.__module__}:{cls.__qualname__}",
                              tuple(f.name for f in attrs.fields(cls)))
    return layout


def _is_torch_tensor(obj: Any) -> bool:
    module = type(obj).__module__
    return module.startswith("torch") and type(obj).__name__ in ("Tensor", "Parameter")


def _torch_meta(tensor: Any, frames: list) -> dict:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.contiguous()
    frames.append(_raw_buffer(tensor))
    return {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
            "frame": len(frames) - 1}


def _raw_buffer(tensor: Any) -> memoryview:
    """A zero-copy view of a contiguous CPU tensor's bytes that keeps the tensor alive."""
    size = tensor.numel() * tensor.element_size()
    if size == 0:
        return memoryview(b"")
    array = (ctypes.c_char * size).from_address(tensor.data_ptr())
    array._owner = tensor  # the view must not outlive the tensor it points into
    return memoryview(array).cast("B")


def _torch_from(meta: dict, frames: list) -> Any:
    import torch

    name = meta["dtype"]
    if type(name) is not str or name not in TORCH_DTYPES:
        raise SerializeError(f"unknown torch dtype {str(name)[:40]!r}: one of "
                             f"{', '.join(sorted(TORCH_DTYPES))} is expected")
    dtype = getattr(torch, name)
    buffer = _frame(frames, meta["frame"])
    shape = [int(d) for d in meta["shape"]]
    if buffer.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    expected = dtype.itemsize * _numel(shape)
    if buffer.nbytes != expected:
        raise SerializeError(
            f"tensor of shape {shape} and dtype {meta['dtype']} needs {expected} bytes, "
            f"its frame has {buffer.nbytes}"
        )
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(shape)


def _numpy_meta(array: Any, frames: list) -> dict:
    import numpy

    array = numpy.ascontiguousarray(array)
    frames.append(memoryview(array).cast("B") if array.size else memoryview(b""))
    return {"dtype": array.dtype.str, "shape": list(array.shape), "frame": len(frames) - 1}


def _numpy_from(meta: dict, frames: list) -> Any:
    import numpy

    buffer = _frame(frames, meta["frame"])
    dtype = numpy.dtype(meta["dtype"])
    shape = [int(d) for d in meta["shape"]]
    if buffer.nbytes != dtype.itemsize * _numel(shape):
        raise SerializeError(f"array of shape {shape} does not match its {buffer.nbytes} bytes")
    return numpy.frombuffer(buffer, dtype=dtype).reshape(shape)


def _frame(frames: list, index: Any) -> memoryview:
    if not isinstance(index, int) or not 0 <= index < len(frames):
        raise SerializeError(f"value refers to frame {index!r}, but the message has "
                             f"{len(frames)} frames (truncated?)")
    frame = frames[index]
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        if d < 0:
            raise SerializeError(f"negative dimension in shape {shape}")
        n *= d
    return n


# [Note: record registry] A record on the wire names its class ("module:QualName"). The
# receiver never imports that module: it looks the class up among those this process declares
# (the op contract's records, flowkit.ops.records and flowkit.dsl.metrics; the attrs classes of
# the modules that declared @op functions, the run's own code loaded before any message; classes
# registered with `allow_records`; on an executor, the modules its controller declared in
# WELCOME), and only if the name is an attrs class defined in that module (read from its
# namespace, so no module __getattr__ runs). Anything else is a SerializeError that rejects the
# message. A contract or declared module is imported when its first record arrives, not before:
# no message adds to those lists, and a process that never sees such a record never loads the
# module (the DSL's objects slow every garbage collection of a dispatch-bound controller; a
# library importing torch costs an executor seconds of CPU). Flow files, loaded with --code under
# a name of their own, are never imported by name. See docs/security.md, "Records on the wire".
CONTRACT_MODULES = frozenset({"flowkit.ops.records", "flowkit.dsl.metrics"})
_RECORDS: dict[str, type] = {}  # path -> class, those found or registered
_DECLARED: set[str] = set()  # modules declared by this executor's controller
_FLOW_FILE_PREFIX = "_flowkit_user_"  # the module name a flow file is loaded under (--code)


def declare_modules(names: list[str]) -> None:
    """Let records of these (loaded) modules be rebuilt: what an executor's controller declares
    [Note: record registry]."""
    _DECLARED.update(names)


def declared_modules() -> list[str]:
    """Every module whose attrs records this process rebuilds: what a controller declares to
    its executors."""
    registered = {cls.__module__ for cls in _RECORDS.values()}
    return sorted(CONTRACT_MODULES | _op_modules() | _DECLARED | registered)


def _op_modules() -> frozenset[str]:
    """The modules of the @op functions declared here: none while the DSL is not loaded (and
    asking must not load it)."""
    operators = sys.modules.get("flowkit.dsl.operators")
    return frozenset() if operators is None else operators.op_modules()


def allow_records(*classes: type) -> None:
    """Let values hold records of these attrs classes [Note: record registry]: for a program
    that sends records not defined beside its @op functions."""
    for cls in classes:
        if not (isinstance(cls, type) and attrs.has(cls)):
            raise TypeError(f"allow_records takes attrs classes, not {cls!r}")
        _RECORDS[f"{cls.__module__}:{cls.__qualname__}"] = cls


def _record_from(path: Any, fields: Any) -> Any:
    if not isinstance(fields, dict):
        raise SerializeError(f"record {str(path)[:200]!r}: its fields must be a map of names")
    cls = _record_class(path)
    try:
        return cls(**fields)  # keywords must be strings: checked only if it fails
    except TypeError:
        if not all(type(k) is str for k in fields):
            raise SerializeError(f"record {str(path)[:200]!r}: its fields must be a map of "
                                 "names") from None
        raise


def _record_class(path: Any) -> type:
    cls = _RECORDS.get(path) if type(path) is str else None
    if cls is not None:
        return cls
    shown = repr(str(path)[:200])
    module_name, _, qualname = str(path).partition(":")
    if module_name in CONTRACT_MODULES or module_name in _DECLARED and not (
            module_name in sys.modules or module_name.startswith(_FLOW_FILE_PREFIX)):
        importlib.import_module(module_name)  # declared, not yet needed: [Note: record registry]
    elif module_name not in _op_modules() and module_name not in _DECLARED:
        raise SerializeError(
            f"record class {shown} is not one this process declares: records come from the op "
            "contract (flowkit.ops.records), the modules of the run's @op functions, or "
            "flowkit.wire.serialize.allow_records; refusing to build it")
    obj: Any = sys.modules.get(module_name)
    for part in qualname.split(".") if obj is not None else ():
        obj = vars(obj).get(part) if hasattr(obj, "__dict__") else None
    if not (isinstance(obj, type) and attrs.has(obj) and obj.__module__ == module_name):
        raise SerializeError(f"{shown} is not an attrs record class of a loaded module; "
                             "refusing to build it")
    _RECORDS[path] = obj
    return obj
