"""Lineages sort the same by the tuples themselves as by `lineage_order`, whenever the tuples
compare at all; mixed ints and strings at one position fall back to the key."""

from hypothesis import given
from hypothesis import strategies as st

from flowkit.runner.stepstate import ItemStream, lineage_order, sorted_lineages

parts = st.one_of(st.integers(-3, 3), st.sampled_from(["a", "b", "k0"]))


@given(st.lists(st.lists(parts, min_size=1, max_size=4).map(tuple), max_size=30, unique=True))
def test_sorted_lineages_orders_as_the_key_does(lineages):
    assert sorted_lineages(lineages) == sorted(lineages, key=lineage_order)


def test_a_streams_order_is_sorted_once_and_follows_new_items():
    stream = ItemStream()
    for lineage in [(2, 0), (0, "g1"), (0, 1), (1,)]:
        stream.add(lineage, lineage)
    first = stream.ordered()
    assert first == [(0, 1), (0, "g1"), (1,), (2, 0)]
    assert stream.ordered() is first  # nothing came: the same answer
    stream.add((0, 0), (0, 0))
    assert stream.ordered()[0] == (0, 0)
