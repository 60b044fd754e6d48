"""Weights handed between executors on one GPU [Note: weights on one GPU in
executors/torch/cuda_share.py]: the CPU part of it (the buffer's layout, a reader in the
exporting process, every check of a record that came over the wire, who is asked to share);
the IPC itself runs in the GPU device check (tools/gpu/device_check.sh, weights_ipc)."""

from __future__ import annotations

import os

import pytest
import torch

from executors.optable import OpTable
from executors.settings import gpu_identity
from executors.torch import cuda_share, weights
from executors.torch import register as register_torch
from executors.torch.errors import StageError
from executors.torch.models.built import held_model
from flowkit.ops.records import SharedWeights, WeightsVersion
from flowkit.runner.weight_sync import one_gpu
from flowkit.runtime.registry import ExecutorInfo
from flowkit.wire.serialize import pack, unpack
from tests.harness import gpt_spec, op_context, tiny_gpt

SPEC = gpt_spec("actor", tiny_gpt(n_layer=4), seed=3)
_TABLE = OpTable()
register_torch(_TABLE)


def _shared_gpt(ctx, stages: int = 2) -> tuple[list[SharedWeights], dict[str, torch.Tensor]]:
    """Each stage of a GPT held here, shared with this executor alone, and its plain export."""
    held = held_model(ctx, {**SPEC, "stages": stages})
    names = held.layout.check().names
    shared = [cuda_share.share(*weights.exported(part, names[s]), [ctx.name], ctx.name,
                               slot=f"actor/{stages}/{s}") for s, part in enumerate(held.parts)]
    plain = weights.merge([weights.export(part, names[s]) for s, part in enumerate(held.parts)])
    return shared, plain


def test_a_reader_in_the_exporting_process_gets_every_weight_from_one_buffer():
    ctx = op_context()
    shared, plain = _shared_gpt(ctx)
    opened = weights.merge([cuda_share.opened(s, ctx.name, torch.device("cpu")) for s in shared])
    assert opened.keys() == plain.keys()
    for name, value in plain.items():
        assert torch.equal(opened[name], value), name
    pointers = {t.untyped_storage().data_ptr() for t in opened.values()}
    assert len(pointers) == len(shared)  # one buffer a stage, every tensor a view of it


def test_load_weights_takes_shared_weights_as_it_takes_host_copies():
    ctx = op_context()
    trained = held_model(ctx, {**SPEC, "stages": 2})
    with torch.no_grad():
        for part in trained.parts:
            for p in part.parameters():
                p.add_(0.5)
    shared, plain = _shared_gpt(ctx)
    loaded = _TABLE.get("load_weights")(ctx, *shared, WeightsVersion(model="actor", version=4),
                                       stages=1, complete=True, **SPEC)
    assert loaded.version == 4
    whole = held_model(ctx, {**SPEC, "stages": 1})
    got = weights.export(whole.parts[0], whole.layout.names[0])
    assert all(torch.equal(got[name], plain[name]) for name in got)


def test_an_executor_holding_many_stages_keeps_each_ones_export_for_its_own_load():
    """A stage's exports are kept apart from another's: three stages (interleaved chunks), two
    syncs each before the loads, evict none of the newest."""
    ctx = op_context()
    _shared_gpt(ctx, stages=3)
    shared, plain = _shared_gpt(ctx, stages=3)
    opened = weights.merge([cuda_share.opened(s, ctx.name, torch.device("cpu")) for s in shared])
    assert all(torch.equal(opened[name], value) for name, value in plain.items())


def test_a_shared_export_is_kept_for_its_reader_only_a_short_while():
    ctx = op_context()
    first, _ = _shared_gpt(ctx, stages=1)
    for _ in range(2):
        _shared_gpt(ctx, stages=1)
    with pytest.raises(StageError, match="no longer kept"):
        cuda_share.opened(first[0], ctx.name, torch.device("cpu"))


def test_weights_on_the_cpu_are_not_shared_with_another_process():
    params = [torch.ones(3)]
    with pytest.raises(StageError, match="only a GPU's"):
        cuda_share.share(params, [("w", 0)], ["exec0", "exec1"], "exec0")


# -- a record from another process, as the wire brings it -------------------------------------
def _remote(**changes) -> SharedWeights:
    fields = dict(
        gpu="GPU-1", pid=os.getpid() + 1, process="another", key=7,
        handle=b"\x02c" + b"h" * 64, size=4096, offset=512,
        readers={"exec1": [f"/torch_{os.getpid() + 1}_123_4", 3, b"e" * 64, True]},
        tensors=[["a.weight", "float32", [4, 8], 0], ["b.bias", "bfloat16", [8], 128]])
    fields.update(changes)
    return SharedWeights(**fields)


def test_a_record_round_trips_through_the_wire_and_its_places_are_checked():
    record = _remote()
    assert unpack(*pack(record)) == record
    places = cuda_share.checked_places(record, "exec1")
    assert places == [("a.weight", (torch.float32, [4, 8], 0)),
                      ("b.bias", (torch.bfloat16, [8], 128))]


def _entry(**changes) -> dict:
    entry = dict(counter=f"/torch_{os.getpid() + 1}_123_4", slot=3, event=b"e" * 64, wait=True)
    entry.update(changes)
    return {"exec1": list(entry.values())}


@pytest.mark.parametrize(("changes", "says"), [
    ({"gpu": 5}, "UUID string"),
    ({"pid": -1}, "positive integers"),
    ({"size": 0}, "size"),
    ({"size": 1 << 50}, "size"),
    ({"offset": -4}, "offset"),
    ({"readers": {"exec2": None}}, "not one of its readers"),
    ({"handle": b"h" * 65}, "memory handle"),
    ({"handle": b"\x02c" + b"h" * 63}, "memory handle"),
    ({"handle": b"\x02e" + b"h" * 64}, "expandable segment"),
    ({"handle": b""}, "memory handle"),
    ({"readers": {"exec1": ["/torch_1_2_3", 3, b"e" * 64, True]}}, "counter file of the"),
    ({"readers": _entry(counter="/dev/shm/flowkit_x")}, "counter file of the"),
    ({"readers": _entry(counter=f"/torch_{os.getpid() + 1}_1_2/../x")}, "counter file of the"),
    ({"readers": _entry(slot=10_000)}, "slot"),
    ({"readers": _entry(slot=-1)}, "slot"),
    ({"readers": _entry(event=b"e")}, "event handle"),
    ({"readers": _entry(wait=1)}, "event handle"),
    ({"readers": {"exec1": [1, 2]}}, "reader's entry"),
    ({"tensors": []}, "non-empty list"),
    ({"tensors": [["a", "float32", [4], 0], ["a", "float32", [4], 64]]}, "distinct"),
    ({"tensors": [["a", "object", [4], 0]]}, "unknown dtype"),
    ({"tensors": [["a", "float32", [1] * 9, 0]]}, "shape"),
    ({"tensors": [["a", "float32", [-1], 0]]}, "shape"),
    ({"tensors": [["a", "float32", [2000], 0]]}, "does not lie within"),
    ({"tensors": [["a", "float32", [4], 4094]]}, "does not lie within"),
    ({"tensors": [["a", "float32", [4], 2]]}, "does not lie within"),
    ({"tensors": [["a", "float32", [4]]]}, "must be \\[name"),
])
def test_every_field_of_a_record_is_checked_before_anything_is_opened(changes, says):
    with pytest.raises(StageError, match=says):
        cuda_share.checked_places(_remote(**changes), "exec1")


def test_a_record_from_another_process_is_refused_on_a_cpu_device():
    with pytest.raises(StageError, match="holds the model on cpu.*--weight-sync host"):
        cuda_share.opened(_remote(), "exec1", torch.device("cpu"))


def test_something_other_than_a_record_is_refused():
    with pytest.raises(StageError, match="expected SharedWeights"):
        cuda_share.checked_places({"gpu": "x"}, "exec1")


# -- who is asked to share ----------------------------------------------------------------------
@pytest.mark.parametrize(("device", "environ", "expected"), [
    ("cpu", {}, None),
    ("cuda:0", {}, "h/0"),
    ("cuda", {}, "h/0"),
    ("cuda:1", {}, "h/1"),
    ("cuda:0", {"CUDA_VISIBLE_DEVICES": "4"}, "h/4"),
    ("cuda:1", {"CUDA_VISIBLE_DEVICES": "4,GPU-abc"}, "h/GPU-abc"),
    ("cuda:2", {"CUDA_VISIBLE_DEVICES": "4,5"}, None),
    ("cuda:0", {"CUDA_VISIBLE_DEVICES": ""}, None),
    ("cuda:x", {}, None),
])
def test_an_executor_reports_which_gpu_it_is_on(device, environ, expected):
    assert gpu_identity(device, "h", environ) == expected


def _executor(i: int, gpu: str | None) -> ExecutorInfo:
    return ExecutorInfo(id=i, name=f"e{i}", tags=(), ops=frozenset(), pid=i, host="h",
                        device="cuda:0", peer_address="", identity=b"",
                        resources={} if gpu is None else {"gpu": gpu})


def test_weights_are_shared_only_among_executors_that_all_report_one_gpu():
    assert one_gpu([_executor(0, "h/0"), _executor(1, "h/0")])
    assert not one_gpu([_executor(0, "h/0"), _executor(1, "h/1")])
    assert not one_gpu([_executor(0, "h/0"), _executor(1, None)])
    assert not one_gpu([_executor(0, None), _executor(1, None)])

