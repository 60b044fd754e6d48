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


def _joined(name: str = "actor/weights/0/0"):
    """An executor alone in a gloo weight group, joined as the runner joins one."""
    ctx = op_context()
    store = _TABLE.get("replica_store")(ctx, group=name, size=1)
    _TABLE.get("replica_group")(ctx, store, group=name, rank=0, size=1)
    return ctx


def test_an_exporter_that_loads_its_own_stage_takes_its_buffer():
    ctx = _joined()
    params = [torch.randn(3, 4, dtype=torch.float64), torch.arange(5, dtype=torch.int64)]
    named = [("a.weight", 0), ("b.tied", 1), ("c.tied", 1)]
    record = weight_broadcast.send(ctx, params, named, "actor/weights/0/0")
    got = weight_broadcast.received(ctx, record, torch.device("cpu"), limit=1 << 20)
    assert torch.equal(got["a.weight"], params[0]) and torch.equal(got["c.tied"], params[1])
    again = weight_broadcast.send(ctx, [p + 1 for p in params], named, "actor/weights/0/0")
    assert torch.equal(weight_broadcast.received(ctx, again, torch.device("cpu"),
                                                 limit=1 << 20)["a.weight"], params[0] + 1)
    _TABLE.get("leave_replica_groups")(ctx, groups=["actor/weights/0/0"])
    assert "actor/weights/0/0" not in ctx.state["weight_sends"]


def _record(**changes) -> BroadcastWeights:
    fields = dict(group="actor/weights/0/0", size=256,
                  tensors=[["a.weight", "float32", [4, 8], 0], ["b.bias", "float64", [8], 128]])
    fields.update(changes)
    return BroadcastWeights(**fields)


@pytest.mark.parametrize(("changes", "says"), [
    ({"group": 3}, "group must be named"),
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
        weight_broadcast.received(ctx, _record(**changes), torch.device("cpu"), limit=4096)


def test_a_record_this_executor_did_not_send_is_refused_on_rank_0():
    ctx = _joined()
    with pytest.raises(StageError, match="sent no such buffer"):
        weight_broadcast.received(ctx, _record(), torch.device("cpu"), limit=4096)


def test_only_rank_0_sends_and_something_else_is_refused():
    ctx = _joined()
    with pytest.raises(StageError, match="in no weight group"):
        weight_broadcast.send(ctx, [torch.ones(2)], [("w", 0)], "elsewhere")
    with pytest.raises(StageError, match="expected BroadcastWeights"):
        weight_broadcast.received(ctx, {"group": "x"}, torch.device("cpu"), limit=4096)


def test_the_packed_copy_lays_each_name_where_its_record_says():
    params = [torch.ones(3, dtype=torch.bfloat16), torch.zeros(2, 2)]
    flat, entries = weights.packed_copy(params, [("x", 0), ("y", 1)])
    assert entries == [["x", "bfloat16", [3], 0], ["y", "float32", [2, 2], 64]]
    assert flat.numel() == 64 + 16
