import attrs
import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowkit.wire.serialize import SerializeError, allow_records, pack, unpack


@attrs.frozen
class Sample:
    prompt_id: int
    tokens: list
    logits: object = None


allow_records(Sample)  # a record this test module sends [Note: record registry]


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


_CHECK_DTYPES = """
import sys, msgpack, torch
from flowkit.wire.serialize import SerializeError, pack, unpack
_, frames = pack(torch.zeros(4))
for name in ("_inductor", "has_cuda", "Tensor", "float32x"):
    meta = msgpack.packb({"dtype": name, "shape": [4], "frame": 0})
    try:
        unpack(msgpack.packb(msgpack.ExtType(1, meta)), frames)
    except SerializeError as exc:
        print(exc)
print("torch._inductor" in sys.modules)
"""


def test_a_tensor_dtype_is_one_of_torchs_dtypes_and_naming_one_imports_nothing():
    """[finding 6 of issue 53] `getattr(torch, name)` for any name imported torch._inductor."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    lines = subprocess.run([sys.executable, "-c", _CHECK_DTYPES], cwd=root, check=True,
                           capture_output=True, text=True, timeout=120).stdout.splitlines()
    assert lines[-1] == "False", lines
    assert len(lines) == 5 and all("unknown torch dtype" in line for line in lines[:4]), lines


def _forged_record(path, fields=None, *, inline: bool = False) -> bytes:
    """A record as a sender would write it: inline [Note: records inline], or as the extension
    holding its own body that senders wrote before (still read)."""
    if inline:
        return msgpack.packb({msgpack.ExtType(5, b""): path, **(fields or {})})
    return msgpack.packb(msgpack.ExtType(3, msgpack.packb([path, fields or {}])))


@pytest.mark.parametrize("inline", [True, False])
def test_records_are_only_rebuilt_from_declared_attrs_classes(inline):
    with pytest.raises(SerializeError, match="not one this process declares"):
        unpack(_forged_record("os:getcwd", inline=inline), [])
    with pytest.raises(SerializeError, match="not one this process declares"):
        unpack(_forged_record("nowhere.at_all:Thing", inline=inline), [])
    with pytest.raises(SerializeError, match="not one this process declares"):
        unpack(_forged_record(["flowkit.ops.records:Prompt"], inline=inline), [])
    # a declared module, but no attrs class by that name
    with pytest.raises(SerializeError, match="not an attrs record class"):
        unpack(_forged_record("flowkit.ops.records:attrs", inline=inline), [])
    with pytest.raises(SerializeError, match="fields must be a map"):
        unpack(_forged_record("flowkit.ops.records:Prompt", {1: 2, "tokens": []}
                              if inline else [1, 2], inline=inline), [])
    with pytest.raises(SerializeError, match="unexpected keyword argument 'rogue'"):
        unpack(_forged_record("flowkit.ops.records:Prompt", {"prompt_id": 1, "tokens": [],
                                                               "rogue": 1}, inline=inline), [])


def test_a_record_travels_inline_and_the_older_form_still_reads():
    from flowkit.ops.records import Prompt

    value = [Prompt(prompt_id=3, tokens=[1, 2]), {"note": Prompt(prompt_id=4, tokens=[])}]
    body, _ = pack(value)
    raw = msgpack.unpackb(body, strict_map_key=False)  # a map with the path key
    assert raw[0] == {msgpack.ExtType(5, b""): "flowkit.ops.records:Prompt", "prompt_id": 3,
                      "tokens": [1, 2], "answer": None, "text": None, "messages": None,
                      "n": None}
    assert unpack(body, []) == value
    old = _forged_record("flowkit.ops.records:Prompt", {"prompt_id": 3, "tokens": [1, 2]})
    assert unpack(old, []) == Prompt(prompt_id=3, tokens=[1, 2])


def test_a_record_key_anywhere_but_heading_a_record_is_refused():
    # [Note: records inline]: the key's marker never reaches a value
    key, prompt = msgpack.ExtType(5, b""), "flowkit.ops.records:Prompt"
    for forged in ([key], {"a": key}, {key: prompt, "prompt_id": key, "tokens": []},
                   {key: key}, [msgpack.ExtType(5, b"x")]):
        with pytest.raises(SerializeError, match="record key|record class"):
            unpack(msgpack.packb(forged), [])
    assert unpack(msgpack.packb([{key: prompt, "prompt_id": 1, "tokens": []}]), [])


def test_extensions_nested_past_a_bound_are_refused_not_a_crash():
    body = msgpack.packb([])
    for _ in range(400):  # each level a msgpack call of its own: this deep would crash
        body = msgpack.packb(msgpack.ExtType(4, body))
    with pytest.raises(SerializeError, match="more than 32 deep"):
        unpack(body, [])
    assert _round_trip(((((1,),),),)) == ((((1,),),),)  # a few levels are fine


def test_a_large_body_decodes_with_the_collector_paused_and_leaves_it_as_it_was(monkeypatch):
    # [Note: no collections while decoding]
    import gc

    from flowkit.wire import serialize

    seen = []
    real = serialize._unpackb
    monkeypatch.setattr(serialize, "_unpackb",
                        lambda *a: seen.append(gc.isenabled()) or real(*a))
    small, large = pack([Sample(1, [1])]), pack([Sample(i, [i] * 64) for i in range(400)])
    assert len(large[0]) >= serialize._PAUSE_GC_BYTES > len(small[0])
    assert unpack(*small) and unpack(*large) and gc.isenabled()
    assert seen == [True, False]
    with pytest.raises(SerializeError):  # a failure turns the collector back on too
        unpack(large[0][:-3], [])
    assert gc.isenabled()
    gc.disable()
    try:
        unpack(*large)
        assert not gc.isenabled()  # left off, as its owner had it
    finally:
        gc.enable()


@pytest.mark.parametrize("inline", [True, False])
def test_a_record_never_imports_the_module_it_names(tmp_path, monkeypatch, inline):
    """A module on the path that would leave a sentinel file if imported stays unimported."""
    import sys

    sentinel = tmp_path / "imported"
    (tmp_path / "rogue_records.py").write_text(
        f"open({str(sentinel)!r}, 'w').close()\nimport attrs\n"
        "@attrs.define\nclass Thing:\n    x: int = 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for path in ("rogue_records:Thing", "venv.__main__:x", "antigravity:x"):
        with pytest.raises(SerializeError):
            unpack(_forged_record(path, inline=inline), [])
    assert not sentinel.exists() and "rogue_records" not in sys.modules
    assert "antigravity" not in sys.modules


def test_records_of_op_modules_and_the_op_contract_are_rebuilt():
    from flowkit.ops.records import Prompt

    value = Prompt(prompt_id=3, tokens=[1, 2])
    assert _round_trip(value) == value


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
