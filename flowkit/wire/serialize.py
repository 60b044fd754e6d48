"""Values on the wire without pickle: msgpack for plain data, raw frames for tensor bytes.

`pack(value)` walks any nesting of None, bool, int, float, str, bytes, list, tuple, dict, attrs
records, torch tensors and numpy arrays. Tensors travel out of band: their bytes become separate
zmq frames (zero-copy on the sending side) and the body holds dtype, shape and a frame index.
Records travel as their class path and fields; the receiver rebuilds them only when the path
names an attrs class, so a message can never make the receiver call arbitrary code.
"""

from __future__ import annotations

import ctypes
import importlib
import warnings
from typing import Any

import attrs
import msgpack

__all__ = ["SerializeError", "pack", "unpack", "nbytes_of"]

_TENSOR, _NDARRAY, _RECORD, _TUPLE = 1, 2, 3, 4

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
    try:
        return _unpackb(body, _Unpacker(frames).ext_hook)
    except SerializeError:
        raise
    except Exception as exc:
        raise SerializeError(f"cannot decode value: {exc.__class__.__name__}: {exc}") from None


# The hooks are bound methods of small objects rather than closures: a closure that passes
# itself to msgpack refers to itself, a reference cycle that keeps every frame (and so every
# tensor) alive until the cycle collector happens to run.
class _Packer:
    __slots__ = ("frames",)

    def __init__(self) -> None:
        self.frames: list = []

    def default(self, obj: Any) -> msgpack.ExtType:
        if isinstance(obj, tuple):
            return msgpack.ExtType(_TUPLE, _packb(list(obj), self.default))
        if _is_torch_tensor(obj):
            return msgpack.ExtType(_TENSOR, _packb(_torch_meta(obj, self.frames), self.default))
        if type(obj).__module__ == "numpy" and hasattr(obj, "__array_interface__"):
            return msgpack.ExtType(_NDARRAY, _packb(_numpy_meta(obj, self.frames),
                                                    self.default))
        if attrs.has(type(obj)):
            cls = type(obj)
            fields = {f.name: getattr(obj, f.name) for f in attrs.fields(cls)}
            path = f"{cls.__module__}:{cls.__qualname__}"
            return msgpack.ExtType(_RECORD, _packb([path, fields], self.default))
        raise SerializeError(
            f"cannot send a {type(obj).__qualname__}: values on the wire are plain data, attrs "
            "records, torch tensors or numpy arrays"
        )


class _Unpacker:
    __slots__ = ("frames",)

    def __init__(self, frames: list) -> None:
        self.frames = frames

    def ext_hook(self, code: int, data: bytes) -> Any:
        payload = _unpackb(data, self.ext_hook)
        if code == _TUPLE:
            return tuple(payload)
        if code == _TENSOR:
            return _torch_from(payload, self.frames)
        if code == _NDARRAY:
            return _numpy_from(payload, self.frames)
        if code == _RECORD:
            return _record_from(*payload)
        raise SerializeError(f"unknown extension type {code} in a value")


def nbytes_of(frames: list) -> int:
    return sum(memoryview(f).nbytes if not hasattr(f, "nbytes") else f.nbytes for f in frames)


def _packb(value: Any, default) -> bytes:
    # tuples go through `default` (strict_types) so they come back as tuples, not lists
    return msgpack.packb(value, default=default, use_bin_type=True, strict_types=True)


def _unpackb(data: bytes, ext_hook) -> Any:
    return msgpack.unpackb(data, ext_hook=ext_hook, raw=False, strict_map_key=False)


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

    dtype = getattr(torch, meta["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise SerializeError(f"unknown torch dtype {meta['dtype']!r}")
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


def _record_from(path: str, fields: dict) -> Any:
    module_name, _, qualname = str(path).partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        raise SerializeError(f"record class {path!r} cannot be found here") from None
    if not (isinstance(obj, type) and attrs.has(obj)):
        raise SerializeError(f"{path!r} is not an attrs record class; refusing to build it")
    return obj(**fields)
