"""Keep freed memory in the process: a training stage allocates and frees the same sizes every
microbatch, and a heap that hands them back to the OS pays for it in page faults on the next
op (B after a W that freed its stash: thousands of faults, a tenth of the op's time here)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


@functools.cache
def keep_freed_memory(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 62) -> bool:
    """Serve blocks below `mmap_threshold` from the heap and never trim it (glibc's mallopt;
    the MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ variables, set from inside). False
    where the C library is not glibc: nothing changes there."""
    path = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(path)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    trim = min(trim_threshold, 2**31 - 1)  # an int in the C signature
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim))
