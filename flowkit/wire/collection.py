"""How a controller and its executors run CPython's cycle collector while they work.

[Note: garbage collection] A step holds hundreds of thousands of small containers on every
process (futures, refs and lineages on the controller; records and their token lists on the
executors), and almost none of them is ever in a cycle: reference counting frees them when the
step is done. CPython's generational collector (3.10–3.13; 3.14's incremental one reads the
older thresholds differently) counts net allocations of containers and by default runs a young
collection every 700, an older one every 10 of those, walking what has survived since. Each
walk visits a container's contents (a record's token list element by element), and on the
executors found nothing to free: at the defaults the collector took a quarter of the
controller's time at 16k samples a step, and at 50,000 a young collection still cost an
executor 20–26 ms. While a run lasts, each process:

- freezes what exists out of the collector's walks (the code loaded and what the process
  holds before its first step; a cycle already garbage then waits for the collections after
  the run, which spares every run a full collection: a tenth of a second in a process that
  loaded torch);
- runs a young collection only every `YOUNG_COLLECTION` net allocations. The count is net (a
  freed container takes one off), so what a step makes and frees before the count gets there
  is never walked: at 400,000, a 16k-sample step's objects mostly come and go between two
  collections, and one collection pauses its process 0.1–0.2 s (measured beside 50,000, 200,000
  and 1,000,000 on `flowkit bench scale`'s 16k-sample step: docs/performance.md).

Cycles are still collected: one that becomes garbage young within `YOUNG_COLLECTION`
allocations, one that had lived into an older generation at that generation's next collection
(every 10 young ones, or rarer).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

__all__ = ["COLLECTOR_PAUSE", "YOUNG_COLLECTION", "fewer_collections"]

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
