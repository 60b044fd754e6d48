"""[Note: objects in batches in executors/outbox.py]: small plain objects wait for their peer in
order and go in batches of at most BATCH_BYTES; each object is packed once, a tensor's value
every time (its frames are never kept)."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from executors.outbox import BATCH_BYTES, Outbox, packed
from flowkit.wire.serialize import pack, unpack


@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, BATCH_BYTES // 3)),
                max_size=30))
def test_each_peers_objects_go_in_order_in_batches_within_the_bound(pushes):
    outbox = Outbox()
    for number, (peer, size) in enumerate(pushes):
        outbox.add((peer, ""), number, b"x" * size)
    taken = outbox.take()
    assert not outbox and not outbox.take()
    for peer in ("a", "b"):
        batches = taken.get((peer, ""), [])
        assert all(batch and sum(len(b) for _, b in batch) <= BATCH_BYTES for batch in batches)
        assert [n for batch in batches for n, _ in batch] == [
            n for n, (p, _) in enumerate(pushes) if p == peer]
        # a new batch starts only when the object would not fit the last one
        for before, after in zip(batches, batches[1:]):
            assert sum(len(b) for _, b in before) + len(after[0][1]) > BATCH_BYTES


def test_a_plain_object_is_packed_once_and_a_tensor_each_time():
    bodies: dict[int, bytes] = {}
    value = {"tokens": [1, 2, 3], "reward": 0.5}
    body, frames = packed(7, value, bodies)
    assert (body, frames) == pack(value) and bodies == {7: body}
    value["reward"] = 9.0  # what was packed first is what goes: the object as produced
    assert unpack(*packed(7, value, bodies)) == {"tokens": [1, 2, 3], "reward": 0.5}
    _, frames = packed(8, torch.ones(4), bodies)
    assert len(frames) == 1 and 8 not in bodies
    big = b"y" * (BATCH_BYTES + 1)
    packed(9, big, bodies)
    assert 9 not in bodies  # goes alone as DATA: nothing to keep it for
    assert packed(10, 5, None) == pack(5)
