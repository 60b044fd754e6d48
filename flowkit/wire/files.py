"""Files this process did not write (a checkpoint's), opened contained and read bounded
[Note: contained files].

[Note: contained files] A checkpoint's file is opened without following a link (O_NOFOLLOW)
and without waiting for a writer (O_NONBLOCK: a FIFO in its place would block `open` forever),
then `fstat` says it is a regular file no larger than its limit, before a byte is read; it is
read in pieces into one buffer of its size (no second copy), and hashed in pieces. Names that
make its paths (executors, placements) are plain names: no `/`, no `..`. The controller checks
the folders and the names, and the run state's SHA-256; each executor checks its own files'
before torch parses them. `tests/security/test_checkpoint_contained.py` tries each way out.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat

__all__ = ["FileRefused", "is_plain_name", "open_regular", "read_bounded", "read_regular",
           "sha256_of"]

_PIECE = 16 << 20  # bytes read or hashed at a time
_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@+-]{0,127}")


class FileRefused(ValueError):
    """A file that is not one to read: the message names it and why."""


def is_plain_name(name: object) -> bool:
    """A name that is one path component inside a folder: no separator, no `..`."""
    return isinstance(name, str) and _PLAIN.fullmatch(name) is not None


def open_regular(path: str | os.PathLike, *, limit: int) -> tuple[int, int]:
    """(fd, size) of regular file `path`, opened for reading; FileRefused naming it when it is
    a symbolic link, not a regular file (a FIFO, a device, a folder) or over `limit` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if os.path.islink(path):
            raise FileRefused(f"{path} is a symbolic link; a checkpoint's files must be its "
                              "own") from None
        raise FileRefused(f"cannot read {path}: {exc.strerror or exc}") from None
    info = os.fstat(fd)
    problem = ("" if stat.S_ISREG(info.st_mode) else f"{path} is not a regular file") or (
        f"{path} has {info.st_size} bytes, more than the {limit} it may have"
        if info.st_size > limit else "")
    if problem:
        os.close(fd)
        raise FileRefused(problem)
    os.set_blocking(fd, True)
    return fd, info.st_size


def read_bounded(fd: int, size: int, path: str | os.PathLike) -> bytearray:
    """The `size` bytes of open file `fd`, read in pieces into one buffer; FileRefused when
    the file is shorter than its size said."""
    buffer, done = bytearray(size), 0
    view = memoryview(buffer)
    while done < size:
        got = os.readv(fd, [view[done:done + _PIECE]])
        if not got:
            raise FileRefused(f"{path} ended after {done} of its {size} bytes")
        done += got
    return buffer


def read_regular(path: str | os.PathLike, *, limit: int) -> bytearray:
    """The bytes of regular file `path`, opened as `open_regular` opens it (no link, no other
    kind of file, at most `limit` bytes) and read in pieces; FileRefused otherwise."""
    fd, size = open_regular(path, limit=limit)
    try:
        return read_bounded(fd, size, path)
    finally:
        os.close(fd)


def sha256_of(fd: int, size: int) -> str:
    """The SHA-256 of the first `size` bytes of open file `fd` (read in pieces, the file's
    offset left as it was)."""
    digest, done = hashlib.sha256(), 0
    while done < size:
        piece = os.pread(fd, min(_PIECE, size - done), done)
        if not piece:
            break
        digest.update(piece)
        done += len(piece)
    return digest.hexdigest()
