"""Weights by broadcast [Note: weights by broadcast in executors/torch/weight_broadcast.py], the
parts one process shows: an exporter that loads its own stage takes its buffer, and a record
from the wire is checked before anything is received (whole runs: tests/cli/test_weight_sync.py)."""

from __future__ import annotations

import pytest
import torch

from executors.optable import OpTable
from executors.torch import register as register_torch
from executors.torch import weight_broadcast, weights
from executors.torch.errors import StageError
from flowkit.ops.records import BroadcastWeights
from tests.harness import op_context

_TABLE = OpTable()
register_torch(_TABLE)


GROUP = "actor/weights/0/0"
CPU = torch.device("cpu")


def _joined(name: str = GROUP, *, weights: bool = True):
    """An executor alone in a gloo group, joined as the runner joins a weight group (or, not
    `weights`, a replica group)."""
    ctx = op_context()
    store = _TABLE.get("replica_store")(ctx, group=name, size=1)
    _TABLE.get("replica_group")(ctx, store, group=name, rank=0, size=1, weights=weights)
    return ctx


def _params(shift: float = 0.0) -> list[torch.Tensor]:
    return [torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
            + shift, torch.arange(5, dtype=torch.int64)]


NAMED = [("a.weight", 0), ("b.tied", 1), ("c.tied", 1)]


def test_an_exporter_that_loads_its_own_stage_takes_the_buffer_its_record_names():
    """Two exports before the loads (a later one must not answer an earlier record): each load
    takes the buffer of its own serial."""
    ctx = _joined()
    first = weight_broadcast.send(ctx, _params(), NAMED, GROUP, for_self=True)
    second = weight_broadcast.send(ctx, _params(1.0), NAMED, GROUP, for_self=True)
    assert (first.serial, second.serial) == (0, 1)
    got = weight_broadcast.received(ctx, first, CPU, limit=1 << 20)
    assert torch.equal(got["a.weight"], _params()[0]) and torch.equal(got["c.tied"],
                                                                      _params()[1])
    assert torch.equal(weight_broadcast.received(ctx, second, CPU, limit=1 << 20)["a.weight"],
                       _params(1.0)[0])
    _TABLE.get("leave_replica_groups")(ctx, groups=[GROUP])
    assert GROUP not in ctx.state["weight_sends"] and GROUP not in ctx.state["weight_groups"]


def test_buffers_no_load_of_its_own_waits_for_go_once_sent_and_a_few_are_kept_for_one():
    ctx = _joined()
    for _ in range(3):
        weight_broadcast.send(ctx, _params(), NAMED, GROUP)
    assert len(ctx.state["weight_sends"][GROUP]) == 1  # the newest; the others were sent
    records = [weight_broadcast.send(ctx, _params(), NAMED, GROUP, for_self=True)
               for _ in range(3)]
    with pytest.raises(StageError, match="holds no buffer 3"):
        weight_broadcast.received(ctx, records[0], CPU, limit=1 << 20)
    weight_broadcast.received(ctx, records[2], CPU, limit=1 << 20)


def test_a_record_naming_a_replica_group_is_refused():
    """A record's group must be a weight group: a broadcast in a replica group would cross its
    gradient collectives."""
    ctx = _joined("actor/1x2/0/0", weights=False)
    with pytest.raises(StageError, match="in no weight group"):
        weight_broadcast.received(ctx, _record(group="actor/1x2/0/0"), CPU, limit=4096)
    with pytest.raises(StageError, match="in no weight group"):
        weight_broadcast.send(ctx, _params(), NAMED, "actor/1x2/0/0")


def _record(**changes) -> BroadcastWeights:
    fields = dict(group=GROUP, serial=0, size=256,
                  tensors=[["a.weight", "float32", [4, 8], 0], ["b.bias", "float64", [8], 128]])
    fields.update(changes)
    return BroadcastWeights(**fields)


@pytest.mark.parametrize(("changes", "says"), [
    ({"group": 3}, "group must be named"),
    ({"serial": "0"}, "serial an integer"),
    ({"size": 0}, "size 1..4096"),
    ({"size": 4097}, "size 1..4096"),
    ({"size": "256"}, "size 1..4096"),
    ({"tensors": []}, "non-empty list"),
    ({"tensors": [["a", "float32", [100], 0]]}, "does not lie within"),
    ({"tensors": [["a", "complex", [4], 0]]}, "unknown dtype"),
    ({"group": "nobody/weights/0/0"}, "in no weight group"),
])
def test_a_record_from_the_wire_is_checked_before_anything_is_received(changes, says):
    ctx = _joined()
    with pytest.raises(StageError, match=says):
        weight_broadcast.received(ctx, _record(**changes), CPU, limit=4096)


def test_a_record_this_executor_did_not_send_is_refused_on_rank_0():
    ctx = _joined()
    with pytest.raises(StageError, match="holds no buffer 0"):
        weight_broadcast.received(ctx, _record(), CPU, limit=4096)


def test_a_group_not_joined_and_something_else_than_a_record_are_refused():
    ctx = _joined()
    with pytest.raises(StageError, match="in no weight group"):
        weight_broadcast.send(ctx, [torch.ones(2)], [("w", 0)], "elsewhere")
    with pytest.raises(StageError, match="expected BroadcastWeights"):
        weight_broadcast.received(ctx, {"group": "x"}, CPU, limit=4096)


def test_the_packed_copy_lays_each_name_where_its_record_says():
    params = [torch.ones(3, dtype=torch.bfloat16), torch.zeros(2, 2)]
    flat, entries = weights.packed_copy(params, [("x", 0), ("y", 1)])
    assert entries == [["x", "bfloat16", [3], 0], ["y", "float32", [2, 2], 64]]
    assert flat.numel() == 64 + 16
