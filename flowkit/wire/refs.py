"""Task inputs that name parts of objects: one item of a list, or a list gathered from many.

A Stream's items often come out of one task as one list-valued object; a consumer that runs per
item reads `Item(future, i)`, and one that runs per group or per microbatch reads a `Gather` of
items. On the wire a task input is one of

    42                      the whole object 42
    [42, 3]                 item 3 of object 42 (a list or tuple)
    {"gather": [ref, ...]}  a list built from the refs inside, in order

so an executor only ever indexes and builds lists: nothing on the wire names code to run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from flowkit.wire.schema import ProtocolError

__all__ = ["Gather", "Item", "object_ids", "resolve", "check_ref"]


@attrs.frozen
class Item:
    """Item `index` of the list-valued object that `future` resolves to."""

    future: Any
    index: int


@attrs.frozen
class Gather:
    """A list made on the executor from futures and items, e.g. the samples of one group."""

    parts: Sequence[Any] = attrs.field(converter=tuple)


def object_ids(ref: Any) -> Iterator[int]:
    """Every object id a wire ref reads."""
    if type(ref) is int:
        yield ref
    elif type(ref) is list:
        yield ref[0]
    else:
        for part in ref["gather"]:
            yield from object_ids(part)


def resolve(ref: Any, objects: dict[int, Any]) -> Any:
    """The value a wire ref names, from the executor's objects (all present)."""
    if type(ref) is int:
        return objects[ref]
    if type(ref) is list:
        value, index = objects[ref[0]], ref[1]
        if not isinstance(value, (list, tuple)) or not -len(value) <= index < len(value):
            size = len(value) if isinstance(value, (list, tuple)) else "not a list"
            raise IndexError(f"input asks for item {index} of object {ref[0]} ({size})")
        return value[index]
    return [resolve(part, objects) for part in ref["gather"]]


def check_ref(ref: Any, depth: int = 0) -> None:
    """ProtocolError unless `ref` is a well-formed wire ref."""
    if type(ref) is int:
        return
    if type(ref) is list:
        if len(ref) == 2 and all(type(x) is int for x in ref):
            return
        raise ProtocolError(f"an item input must be [object, index], got {ref!r}")
    if type(ref) is dict and type(ref.get("gather")) is list and depth < 4:
        for part in ref["gather"]:
            check_ref(part, depth + 1)
        return
    raise ProtocolError(f"a task input must be an object id, [object, index] or "
                        f"{{'gather': [...]}} (nested at most 4 deep), got {ref!r:.80}")
