import attrs
import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowkit.wire.serialize import SerializeError, pack, unpack


@attrs.frozen
class Sample:
    prompt_id: int
    tokens: list
    logits: object = None


def _round_trip(value):
    body, frames = pack(value)
    # frames as the receiver sees them: separate byte buffers
    return unpack(body, [bytearray(memoryview(f)) for f in frames])


plain = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12)


@settings(max_examples=150)
@given(plain)
def test_plain_values_round_trip_exactly(value):
    assert _round_trip(value) == value


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                   torch.bool, torch.uint8])
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 5), (2, 0, 3)])
def test_tensors_round_trip_with_dtype_and_shape(dtype, shape):
    tensor = (torch.arange(int(torch.tensor(shape).prod()) if shape else 1) % 2).to(dtype)
    tensor = tensor.reshape(shape)
    back = _round_trip(tensor)
    assert back.dtype == dtype and tuple(back.shape) == shape
    assert torch.equal(back, tensor)


def test_non_contiguous_tensors_and_records_nest():
    base = torch.arange(12.0).reshape(3, 4)
    value = {"t": base.t(), "s": Sample(prompt_id=3, tokens=[1, 2], logits=base[:, 1])}
    back = _round_trip(value)
    assert torch.equal(back["t"], base.t())
    assert back["s"].prompt_id == 3 and torch.equal(back["s"].logits, base[:, 1])


def test_tensor_bytes_travel_out_of_band():
    body, frames = pack(torch.zeros(1024))
    assert len(body) < 100 and sum(memoryview(f).nbytes for f in frames) == 4096


def test_unsupported_values_name_their_type():
    with pytest.raises(SerializeError, match="cannot send a set"):
        pack({1, 2})


def test_a_truncated_tensor_frame_is_rejected():
    body, frames = pack(torch.zeros(16))
    with pytest.raises(SerializeError, match="needs 64 bytes, its frame has 10"):
        unpack(body, [bytes(memoryview(frames[0]))[:10]])
    with pytest.raises(SerializeError, match="truncated"):
        unpack(body, [])


def test_records_are_only_rebuilt_from_attrs_classes():
    forged = msgpack.packb(msgpack.ExtType(3, msgpack.packb(["os:getcwd", {}])))
    with pytest.raises(SerializeError, match="not an attrs record class; refusing"):
        unpack(forged, [])
    missing = msgpack.packb(msgpack.ExtType(3, msgpack.packb(["nowhere.at_all:Thing", {}])))
    with pytest.raises(SerializeError, match="cannot be found"):
        unpack(missing, [])


def test_packing_leaves_no_reference_cycle_holding_tensors():
    import gc
    import weakref

    gc.disable()
    try:
        tensor = torch.arange(8.0)
        alive = weakref.ref(tensor)
        body, frames = pack({"t": tensor})
        value = unpack(body, frames)
        assert torch.equal(value["t"], torch.arange(8.0))
        del tensor, body, frames, value
        assert alive() is None  # freed by reference counting alone
    finally:
        gc.enable()
