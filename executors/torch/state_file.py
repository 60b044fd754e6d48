"""An executor's state on disk: one safetensors file, its tensors by layout-free names and its
plain values (models, versions, shards, hyperparameters, the Python generator) as JSON in the
file's metadata [Note: layout-free checkpoints in executors/torch/layout_free.py]. No pickle:
safetensors reads tensors as bytes of a declared dtype and shape, and the JSON is checked field
by field by its reader (state.py), so a crafted file can build no object and run no code; any
tool that reads safetensors reads the weights.
"""

from __future__ import annotations

import hashlib
import json
import struct

import safetensors.torch
import torch

from executors.torch.errors import StageError
from flowkit.wire.files import FileRefused, read_regular

__all__ = ["FORMAT", "MAX_STATE", "decode", "encode", "read_state_file"]

FORMAT = "flowkit.executor_state/2"
MAX_STATE = 1 << 40  # bytes: past any model this runs, a bound on what a load may read
_MAX_HEADER = 1 << 26  # bytes of a safetensors header: its tensors' names, shapes and offsets
_META_KEY = "flowkit"
_ZIP = b"PK\x03\x04"  # how a torch.save file begins (flowkit.executor_state/1 was one)


def encode(meta: dict, tensors: dict[str, torch.Tensor]) -> bytes:
    """The file's bytes: `tensors` (CPU, each its own storage) and `meta` (JSON values)."""
    text = json.dumps({"format": FORMAT, **meta}, separators=(",", ":"))
    return safetensors.torch.save({k: v.contiguous() for k, v in tensors.items()},
                                  metadata={_META_KEY: text})


def decode(data: bytes | bytearray, path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, tensors) of a file's bytes; a StageError of one line naming `path` when they are
    not an executor state of this flowkit."""
    meta = _metadata(data, path)
    if meta.get("format") != FORMAT:
        raise StageError(f"{path} is an executor state of format {meta.get('format')!r}; this "
                         f"flowkit reads {FORMAT!r}: resume it with the flowkit that wrote it")
    try:
        tensors = safetensors.torch.load(bytes(data))
    except Exception as exc:  # noqa: BLE001 - a damaged or crafted file: whatever it raises
        raise StageError(f"cannot read executor state {path}: {_first_line(exc)}") from None
    return meta, tensors


def _metadata(data: bytes | bytearray, path: str) -> dict:
    """The JSON a state keeps in its safetensors header (8 bytes of its length, then JSON)."""
    problem = f"cannot read executor state {path}: not a safetensors file"
    if bytes(data[:4]) == _ZIP:
        raise StageError(f"cannot read executor state {path}: a torch.save file, an older "
                         f"flowkit's executor state; this flowkit reads {FORMAT!r} (safetensors): "
                         "resume it with the flowkit that wrote it")
    if len(data) < 8:
        raise StageError(f"{problem} (only {len(data)} bytes)")
    (size,) = struct.unpack("<Q", bytes(data[:8]))
    if size > min(_MAX_HEADER, len(data) - 8):
        raise StageError(f"{problem} (a header of {size} bytes in a file of {len(data)})")
    try:
        header = json.loads(bytes(data[8:8 + size]))
        meta = json.loads(header["__metadata__"][_META_KEY])
    except (ValueError, KeyError, TypeError) as exc:
        raise StageError(f"{problem} with flowkit's metadata ({_first_line(exc)})") from None
    if not isinstance(meta, dict):
        raise StageError(f"{path}: its metadata is a {type(meta).__name__}, not a map")
    return meta


def read_state_file(path: str, checksums: dict | None) -> tuple[dict, dict[str, torch.Tensor]]:
    """The state in `path`, a regular file read once and checked against its SHA-256 in
    `checksums` (by path; None: a checkpoint written before them) before a byte of it is
    parsed [Note: contained files in flowkit/wire/files.py]; a link, another kind of file or a
    damaged one is one line."""
    try:
        data = read_regular(path, limit=MAX_STATE)
    except FileRefused as exc:
        raise StageError(f"cannot read executor state: {exc}") from None
    if checksums is not None and checksums.get(path) != hashlib.sha256(data).hexdigest():
        raise StageError(f"{path} does not match its SHA-256 in manifest.json: it changed "
                         "after it was written")
    return decode(data, path)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
