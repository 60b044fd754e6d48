"""How a controller and its executors run CPython's cycle collector while they work.

[Note: garbage collection] A step holds hundreds of thousands of small containers on every
process (futures and refs on the controller, records and their token lists on the executors),
almost none in a cycle: reference counting frees them. CPython's collector (3.10–3.13) runs a
young collection every 700 net container allocations, walking every survivor's contents, and on
the executors found nothing to free. So while a run lasts each process freezes what exists out
of the walks (a cycle already garbage waits for the collections after the run) and runs a young
collection only every `YOUNG_COLLECTION` net allocations: at 400,000 a 16k-sample step's objects
mostly come and go between two collections, one collection pauses its process 0.1–0.2 s, and
the engine's cost a sample was lowest of 50,000, 200,000, 400,000 and 1,000,000 (the 16k step of
`flowkit bench scale`, 2026-11-27; docs/performance-log.md). Cycles are still collected, young
ones within `YOUNG_COLLECTION` allocations, older ones at their generation's next collection.

[Note: imports promoted] An op that imports modules (transformers' lazy imports at an executor's
first Hugging Face build or tokenizer) leaves tens of thousands of long-lived objects young, and
the first young collection walked them all: 0.27-0.34 s on each executor of the README's Qwen2
GRPO, both at step 18-20 (a gc callback's log). So an executor collects generations 0 and 1 right
after such an op (`promote_new_imports`), at start-up, and its later young walks skip them.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
from collections.abc import Iterator

__all__ = ["COLLECTOR_PAUSE", "YOUNG_COLLECTION", "fewer_collections", "fewer_collections_for_good",
           "promote_new_imports"]

YOUNG_COLLECTION = 400_000  # net allocations between young collections


class _Held:
    """A setting of the collector held by any number of holders at once (threads, a run inside
    a test's): the first in sets it, the last out restores what was there before the first."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holders = 0

    def enter(self) -> None:
        with self.lock:
            if self.holders == 0:
                self._set()
            self.holders += 1

    def leave(self) -> None:
        with self.lock:
            self.holders -= 1
            if self.holders == 0:
                self._restore()

    def after_fork(self) -> None:
        self.lock = threading.Lock()  # a copy of a lock another thread held would never open

    def _set(self) -> None:
        raise NotImplementedError

    def _restore(self) -> None:
        raise NotImplementedError


class _Policy(_Held):
    """[Note: garbage collection]: frozen, young collections rarer."""

    saved: tuple[int, ...] = ()
    unfreeze = False

    def _set(self) -> None:
        self.saved = gc.get_threshold()
        # CPython unfreezes all or nothing: what someone else froze stays frozen
        self.unfreeze = gc.get_freeze_count() == 0
        gc.freeze()
        gc.set_threshold(YOUNG_COLLECTION, *self.saved[1:])

    def _restore(self) -> None:
        if gc.get_threshold()[0] == YOUNG_COLLECTION:  # unless set anew meanwhile
            gc.set_threshold(*self.saved)
        if self.unfreeze:
            gc.unfreeze()


class _Pause(_Held):
    """No collections at all ([Note: no collections while decoding] in serialize.py); the
    collector comes back as it was when the first holder came in."""

    was_enabled = False

    def _set(self) -> None:
        self.was_enabled = gc.isenabled()
        gc.disable()

    def _restore(self) -> None:
        if self.was_enabled:
            gc.enable()


_POLICY, COLLECTOR_PAUSE = _Policy(), _Pause()
for _held in (_POLICY, COLLECTOR_PAUSE):
    os.register_at_fork(after_in_child=_held.after_fork)


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """[Note: garbage collection] for as long as the block runs."""
    _POLICY.enter()
    try:
        yield
    finally:
        _POLICY.leave()


def fewer_collections_for_good() -> None:
    """[Note: garbage collection] for the rest of this process (an executor's life): nothing to
    restore, so no count of what was frozen before, a walk of every object a fork server froze
    (5 % of a ten-step executor's CPU, in the same py-spy profile as the finalizers' in
    executors/forkserver.py)."""
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION, *gc.get_threshold()[1:])
    _IMPORTED[0] = len(sys.modules)


_IMPORTED = [0]  # the modules this process had at its last promotion


def promote_new_imports() -> bool:
    """[Note: imports promoted] If modules were imported since the last call, collect
    generations 0 and 1 now, so that what the imports made is walked once, here, and not by
    every young collection until the next one of generation 1. Whether it collected."""
    count = len(sys.modules)
    if count == _IMPORTED[0]:
        return False
    _IMPORTED[0] = count
    gc.collect(1)
    return True
