"""ProtocolError, and the check of a message's (or a task's) fields against a schema: the base
both protocol.py and task.py build on, so neither imports the other for it."""

from __future__ import annotations

import reprlib
from typing import Any

__all__ = ["ProtocolError", "Schema", "check_fields", "shown"]

Schema = dict[str, type | tuple[type, ...]]  # field -> its Python type(s)

_MISSING = object()


class ProtocolError(ValueError):
    """A message that does not follow the protocol; the text says what is wrong with it."""


def check_fields(kind: str, fields: dict[str, Any], schema: Schema) -> None:
    """ProtocolError naming the first field of `schema` that `fields` lacks or mistypes (a bool
    is no int). Fields the schema does not name are allowed: forward compatible."""
    for field, expected in schema.items():
        value = fields.get(field, _MISSING)
        if type(value) is expected:  # msgpack makes exact types: one test in the usual case
            continue
        if value is _MISSING:
            raise ProtocolError(f"{kind}: missing field {field!r}")
        if not isinstance(value, expected) or isinstance(value, bool) and expected is int:
            names = " or ".join(t.__name__ for t in
                                (expected if isinstance(expected, tuple) else (expected,)))
            raise ProtocolError(f"{kind}: field {field!r} must be {names}, got "
                                f"{type(value).__name__}")


def shown(value: Any, limit: int = 80) -> str:
    """A peer-supplied value as logs and messages may show it: escaped (repr: no control
    characters, no terminal escapes, no line breaks) and at most `limit` characters. Only
    a bounded part of a huge value is written out: a 64 MiB name costs what a short one does."""
    if isinstance(value, (str, bytes)) and len(value) > limit:
        value = value[:limit]  # its repr is longer than limit still: cut below
    text = _BRIEF.repr(value) if isinstance(value, (list, tuple, dict, set)) else repr(value)
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


_BRIEF = reprlib.Repr()  # containers: at most a few elements of each, each bounded
_BRIEF.maxstring = _BRIEF.maxother = 80
_BRIEF.maxlist = _BRIEF.maxdict = _BRIEF.maxtuple = _BRIEF.maxset = 8
