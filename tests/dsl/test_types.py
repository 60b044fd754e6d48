from __future__ import annotations

from typing import Any, Optional

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowkit.dsl import Batch, Granularity, Grouped, Stream, Tensor, port_type
from flowkit.dsl.types import assignable, type_name
from tests.dsl.shapes import Prompt, Rollout, Scored


@pytest.mark.parametrize(
    ("annotation", "granularity", "item"),
    [
        (Stream[Rollout], Granularity.STREAM, Rollout),
        (Batch[Rollout], Granularity.BATCH, Rollout),
        (Grouped[Rollout], Granularity.GROUPED, Rollout),
        (Rollout, Granularity.STREAM, Rollout),  # a bare type is one item of a stream
        (Batch, Granularity.BATCH, Any),
    ],
)
def test_port_type_reads_granularity_and_item(annotation, granularity, item):
    ptype = port_type(annotation)
    assert ptype.granularity is granularity
    assert ptype.item is item
    assert ptype.is_barrier == (granularity is Granularity.BATCH)


def test_granularities_do_not_nest():
    with pytest.raises(TypeError, match="do not nest"):
        port_type(Stream[Batch[Rollout]])


def test_port_type_prints_like_its_annotation():
    assert str(port_type(Batch[Tensor["float32", "batch", "seq"]])) == (
        "Batch[Tensor[float32, batch, seq]]"
    )
    assert str(port_type(Stream[list[int]])) == "Stream[list[int]]"


def test_subclass_fits_base_but_not_the_reverse():
    assert assignable(Scored, Rollout) is None
    assert "not Scored" in assignable(Rollout, Scored)
    assert assignable(Prompt, Rollout) is not None


def test_any_and_object_accept_everything():
    assert assignable(Prompt, Any) is None
    assert assignable(Prompt, object) is None
    assert assignable(Any, Prompt) is None


def test_generics_are_covariant():
    assert assignable(list[Scored], list[Rollout]) is None
    assert assignable(list[Rollout], list[Scored]) is not None
    assert assignable(dict[str, Scored], dict[str, Rollout]) is None
    assert assignable(tuple[int, int], tuple[int, ...]) is None
    assert assignable(list[int], list) is None
    assert assignable(list, list[int]) is not None
    assert assignable(list[int], dict[str, int]) is not None


def test_unions():
    assert assignable(Scored, Optional[Rollout]) is None  # noqa: UP045 - the typing spelling too
    assert assignable(int | str, int | str | float) is None
    assert assignable(int | Prompt, int) is not None


def test_tensor_specs_are_cached_classes():
    assert Tensor["float32", "b"] is Tensor["float32", "b"]
    assert issubclass(Tensor["int64"], Tensor)
    assert type_name(Tensor["int64", "batch", 128]) == "Tensor[int64, batch, 128]"


@pytest.mark.parametrize(
    ("produced", "expected", "ok"),
    [
        (Tensor["float32", "b", "t"], Tensor["float32", "b", "t"], True),
        (Tensor["float32", "b", 8], Tensor["float32", "b", "t"], True),  # a size binds a name
        (Tensor["float32", "b", "t"], Tensor["float32", "*", "t"], True),
        (Tensor["float32", "b", "t"], Tensor["float32"], True),  # no dims: any shape
        (Tensor["float32", "b", "t"], Tensor, True),
        (Tensor["float16", "b", "t"], Tensor["float32", "b", "t"], False),
        (Tensor["float32", "b"], Tensor["float32", "b", "t"], False),
        (Tensor["float32", "b", 8], Tensor["float32", "b", 16], False),
        (Tensor["float32", "b", "t"], Tensor["float32", "b", "s"], False),
        (Tensor["float32"], Tensor["float32", "b"], False),
        (Tensor["*", "b"], Tensor["int64", "b"], True),
        (Rollout, Tensor["float32"], False),
    ],
)
def test_tensor_assignability(produced, expected, ok):
    assert (assignable(produced, expected) is None) == ok


def test_tensor_spec_rejects_unknown_dtype_with_the_choices():
    with pytest.raises(TypeError, match="unknown tensor dtype 'float31'.*float32"):
        Tensor["float31", "b"]


_leaf = st.sampled_from([int, float, str, bytes, Prompt, Rollout, Scored])
_types = st.recursive(_leaf, lambda inner: st.one_of(
    inner.map(lambda t: list[t]), st.tuples(inner, inner).map(lambda ts: dict[ts[0], ts[1]])),
    max_leaves=4)


@given(_types)
def test_every_type_fits_itself(tp):
    assert assignable(tp, tp) is None


@given(_types, _types, _types)
def test_assignability_is_transitive(a, b, c):
    if assignable(a, b) is None and assignable(b, c) is None:
        assert assignable(a, c) is None
