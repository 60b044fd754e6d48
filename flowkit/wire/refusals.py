"""What peers send that is refused, counted, and logged at most one line a while for each kind
[Note: refusals].

[Note: refusals] A stranger that floods a socket with messages nobody accepts costs a counter
each, not a log line nor a reply: one line per kind of refusal each `every_s` seconds, saying
how many more there were meanwhile, and no ERROR back to a peer that never said a valid HELLO
(a reply would wait in the ROUTER's queue for a reader that may never come). The controller's
and an executor's data socket refuse this way; `tests/security/test_floods.py` floods both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["Refusals"]

_EVERY_S = 10.0
_KINDS = 1024  # kinds remembered; past that the oldest are forgotten (and logged again)


class Refusals:
    """`refusals.warn(kind, message)`: log `message` (text, or a function that makes it, so a
    silenced refusal costs no formatting) unless a `kind` was logged within the last
    `every_s` seconds; the next line says how many were not logged meanwhile."""

    def __init__(self, logger: logging.Logger, every_s: float = _EVERY_S) -> None:
        self.logger, self.every_s = logger, every_s
        self.count = 0  # refusals in all, for tests and the dashboard
        self._last: dict[str, tuple[float, int]] = {}  # kind -> (when logged, silenced since)

    def warn(self, kind: str, message: str | Callable[[], str]) -> None:
        self.count += 1
        now = time.monotonic()
        logged, silenced = self._last.get(kind, (-self.every_s, 0))
        if now - logged < self.every_s:
            self._last[kind] = (logged, silenced + 1)
            return
        if len(self._last) >= _KINDS:
            self._last.pop(next(iter(self._last)))
        self._last[kind] = (now, 0)
        more = f" ({silenced} more like it not logged)" if silenced else ""
        self.logger.warning("%s%s", message if isinstance(message, str) else message(), more)
