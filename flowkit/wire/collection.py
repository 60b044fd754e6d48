"""How a controller and its executors run CPython's cycle collector while they work.

[Note: garbage collection] A step holds hundreds of thousands of small containers on every
process (futures, refs and lineages on the controller; records and their token lists on the
executors), and almost none of them is ever in a cycle: reference counting frees them when the
step is done. CPython's default thresholds run a young collection every 700 net allocations and
older ones that walk everything since, so that the collector re-walked each step's objects many
times: a quarter of the controller's time at 16k samples a step. While a run lasts, each process
freezes what exists at its start out of the collector's walks (the code loaded, the models) and
runs a young collection only every `YOUNG_COLLECTION` net allocations. The count is net (a freed
container takes one off), so objects that are born and die within a step are never walked; cycles
are still collected, at most that many allocations late. A young collection walks every container
made since the last one and what they hold (a record's token list, element by element), so it is
measured in tens of milliseconds per 100,000: 400,000 keeps a 16k-sample step's objects clear
of most collections and one collection's pause near a tenth of a second (measured beside
50,000, 200,000 and 1,000,000 on `flowkit bench scale`'s 16k-sample step: docs/performance.md).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["YOUNG_COLLECTION", "fewer_collections"]

YOUNG_COLLECTION = 400_000  # net allocations between young collections


class _Policy:
    """Entered by any number of runs at once (threads, a run inside a test's): the first sets
    the policy, the last out restores what was there before the first."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holders = 0
        self.saved: tuple[int, ...] = ()

    def enter(self) -> None:
        with self.lock:
            if self.holders == 0:
                self.saved = gc.get_threshold()
                gc.freeze()
                gc.set_threshold(YOUNG_COLLECTION, *self.saved[1:])
            self.holders += 1

    def leave(self) -> None:
        with self.lock:
            self.holders -= 1
            if self.holders == 0:
                gc.set_threshold(*self.saved)
                gc.unfreeze()


_POLICY = _Policy()


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """[Note: garbage collection] for as long as the block runs."""
    _POLICY.enter()
    try:
        yield
    finally:
        _POLICY.leave()
