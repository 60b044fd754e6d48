"""Port types: what moves along an edge (a record class or a tensor spec) and at which granularity.

[Note: granularity] The granularity of a port tells the planner where stages may fuse:
  Stream[T]   items arrive one at a time; a consumer may start on the first item.
  Batch[T]    the whole collection at once; a Stream only reaches it through `collect`: a barrier.
  Grouped[T]  items arrive in keyed groups (the n samples of one prompt); made by `group_by`.
A bare annotation `T` on a function op means one item: the port is a Stream[T] and the function
is called once per item.
"""

from __future__ import annotations

import enum
import types
import typing
from typing import Any, Generic, TypeVar

import attrs

__all__ = [
    "Batch",
    "Granularity",
    "Grouped",
    "PortType",
    "Stream",
    "Tensor",
    "assignable",
    "port_type",
    "type_name",
]

T = TypeVar("T")


class Stream(Generic[T]):
    """Items of T that arrive one at a time; a consumer may start on the first one."""


class Batch(Generic[T]):
    """All items of T of one step at once: a barrier between a producer and its consumer."""


class Grouped(Generic[T]):
    """Items of T in keyed groups (e.g. the n samples of one prompt), each group whole."""


class Granularity(enum.Enum):
    STREAM = "Stream"
    BATCH = "Batch"
    GROUPED = "Grouped"

    def __str__(self) -> str:
        return self.value


_GRANULARITY_OF = {Stream: Granularity.STREAM, Batch: Granularity.BATCH,
                   Grouped: Granularity.GROUPED}

_DTYPES = frozenset(
    "bool uint8 int8 int16 int32 int64 float16 bfloat16 float32 float64 complex64 *".split()
)


class _TensorMeta(type):
    def __repr__(cls) -> str:
        return type_name(cls)


class Tensor(metaclass=_TensorMeta):
    """A tensor spec: ``Tensor["float32", "batch", "seq"]`` (dtype, then named or sized dims).

    ``Tensor["float32"]`` accepts any shape; ``"*"`` is a wildcard for the dtype or one dim.
    Specs are classes (so they nest inside Stream[...] and typing tools accept them), cached so the
    same spec is the same class.
    """

    dtype: str = "*"
    dims: tuple[str | int, ...] | None = None
    _cache: dict[tuple, type] = {}

    def __class_getitem__(cls, spec: Any) -> type:
        spec = spec if isinstance(spec, tuple) else (spec,)
        dtype, dims = str(spec[0]), spec[1:]
        if dtype not in _DTYPES:
            raise TypeError(
                f"unknown tensor dtype {dtype!r}: use one of {', '.join(sorted(_DTYPES))}"
            )
        for dim in dims:
            if not isinstance(dim, (str, int)) or isinstance(dim, bool):
                raise TypeError(f"tensor dims are names or sizes, got {dim!r} in {spec!r}")
        key = (dtype, tuple(dims) if dims else None)
        if key not in cls._cache:
            cls._cache[key] = _TensorMeta(
                "Tensor", (Tensor,), {"dtype": dtype, "dims": key[1], "__module__": __name__}
            )
        return cls._cache[key]


def type_name(tp: Any) -> str:
    """A short readable name: Rollout, list[int], Tensor[float32, batch, seq]."""
    if isinstance(tp, type) and issubclass(tp, Tensor):
        if tp is Tensor:
            return "Tensor"
        parts = [tp.dtype, *(str(d) for d in tp.dims or ())]
        return f"Tensor[{', '.join(parts)}]"
    if tp is Any:
        return "Any"
    origin = typing.get_origin(tp)
    if origin is not None:
        args = ", ".join(type_name(a) for a in typing.get_args(tp))
        if origin in (typing.Union, types.UnionType):
            return " | ".join(type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if tp is type(None):
        return "None"
    return getattr(tp, "__qualname__", None) or repr(tp)


@attrs.frozen
class PortType:
    """A port's type: the granularity and the type of one item."""

    granularity: Granularity
    item: Any

    def __str__(self) -> str:
        return f"{self.granularity}[{type_name(self.item)}]"

    @property
    def is_barrier(self) -> bool:
        return self.granularity is Granularity.BATCH


def port_type(annotation: Any) -> PortType:
    """Read a port type from an annotation; a bare type means one item of a Stream."""
    if isinstance(annotation, PortType):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in _GRANULARITY_OF:
        (item,) = typing.get_args(annotation)
        if typing.get_origin(item) in _GRANULARITY_OF:
            raise TypeError(f"granularities do not nest: {annotation!r}")
        return PortType(_GRANULARITY_OF[origin], item)
    if annotation in _GRANULARITY_OF:
        return PortType(_GRANULARITY_OF[annotation], Any)
    return PortType(Granularity.STREAM, annotation)


# -- assignability -------------------------------------------------------------------------------
# The rule: a value of type P may flow into a port of type C when P is C or a subclass of C
# (a Rollout subclass is a Rollout); Any on either side matches anything. Generics are covariant:
# list[P] fits list[C] when the origins fit and each argument fits. A union producer fits when
# every member fits; a union consumer when the producer fits one member. Tensor specs fit when
# dtypes agree and dims agree one by one (equal names, equal sizes, a name binds a size, '*' fits
# all); a spec without dims accepts any shape.


def assignable(produced: Any, expected: Any) -> str | None:
    """None if `produced` fits `expected`, else a short reason why not."""
    if produced is expected or expected is Any or produced is Any or expected is object:
        return None
    if _is_union(produced):
        for member in typing.get_args(produced):
            reason = assignable(member, expected)
            if reason:
                return f"the union member {type_name(member)} does not fit: {reason}"
        return None
    if _is_union(expected):
        if any(assignable(produced, m) is None for m in typing.get_args(expected)):
            return None
        return f"{type_name(produced)} is none of {type_name(expected)}"
    if _is_tensor(produced) or _is_tensor(expected):
        return _tensor_assignable(produced, expected)
    p_origin, e_origin = typing.get_origin(produced), typing.get_origin(expected)
    if p_origin is not None or e_origin is not None:
        return _generic_assignable(produced, expected)
    if isinstance(produced, type) and isinstance(expected, type):
        if issubclass(produced, expected):
            return None
        return f"{type_name(produced)} is not {type_name(expected)} or a subclass of it"
    return f"{type_name(produced)} is not {type_name(expected)}"


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _is_tensor(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, Tensor)


def _generic_assignable(produced: Any, expected: Any) -> str | None:
    p_origin = typing.get_origin(produced) or produced
    e_origin = typing.get_origin(expected) or expected
    if not (isinstance(p_origin, type) and isinstance(e_origin, type)):
        return f"{type_name(produced)} is not {type_name(expected)}"
    if not issubclass(p_origin, e_origin):
        return f"{type_name(produced)} is not {type_name(expected)}"
    p_args, e_args = typing.get_args(produced), typing.get_args(expected)
    if not e_args:  # a bare `list` accepts list[anything]
        return None
    if not p_args:
        return f"{type_name(produced)} does not say its item types; {type_name(expected)} does"
    if e_origin is tuple and e_args[-1] is Ellipsis:
        e_args = (e_args[0],) * len(p_args)
    if len(p_args) != len(e_args):
        return f"{type_name(produced)} and {type_name(expected)} have different arity"
    for p_arg, e_arg in zip(p_args, e_args):
        reason = assignable(p_arg, e_arg)
        if reason:
            return f"{type_name(produced)} is not {type_name(expected)}: {reason}"
    return None


def _tensor_assignable(produced: Any, expected: Any) -> str | None:
    if not (_is_tensor(produced) and _is_tensor(expected)):
        return f"{type_name(produced)} is not {type_name(expected)}"
    if expected is Tensor:
        return None
    if produced is Tensor:
        return f"a tensor of unknown dtype and shape is not {type_name(expected)}"
    if "*" not in (produced.dtype, expected.dtype) and produced.dtype != expected.dtype:
        return f"dtype {produced.dtype} is not {expected.dtype}"
    if expected.dims is None:
        return None
    if produced.dims is None:
        return f"a tensor of any shape is not one of shape ({', '.join(map(str, expected.dims))})"
    if len(produced.dims) != len(expected.dims):
        return f"{len(produced.dims)} dims is not {len(expected.dims)} dims"
    for p_dim, e_dim in zip(produced.dims, expected.dims):
        if "*" in (p_dim, e_dim) or p_dim == e_dim:
            continue
        if isinstance(p_dim, int) and isinstance(e_dim, int):
            return f"dim of size {p_dim} is not size {e_dim}"
        if isinstance(p_dim, str) and isinstance(e_dim, str):
            return f"dim {p_dim!r} is not dim {e_dim!r}"
    return None
