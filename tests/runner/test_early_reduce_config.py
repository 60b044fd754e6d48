"""Which ops start a stage's all-reduce [Note: all-reduce in the last W in
executors/torch/train/replicas.py]: each stage's last W (or BW) of a replica's schedule, told
its device's replica group and the order its buckets start in (last first after a fused BW,
for every replica); nothing where a device holds two stages, under FSDP, or on the
simulator."""

from __future__ import annotations

import pytest

from flowkit.dsl import Model
from flowkit.planner import Costs
from flowkit.planner.schedules import build_schedule
from flowkit.planner.simcosts import SimCosts
from flowkit.runner.replicas import Replicas, last_actions, reduce_orders


def _replicas(devices: int, *, groups, shard=None) -> Replicas:
    model = Model(name="m", build="pkg.mod:build", stages=devices, replicas=2, shard=shard)
    dp = Replicas(None, model, [object()] * (2 * devices), SimCosts())
    dp.groups = groups
    return dp


def _schedule(kind: str, devices: int, microbatches: int = 4):
    return build_schedule(kind, devices=devices, microbatches=microbatches,
                          costs=Costs.uniform(devices, F=1.0, B=1.0, W=1.0))


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1", "gpipe"])
@pytest.mark.parametrize("microbatches", [1, 3, 4])
def test_only_each_stages_last_w_or_bw_is_told_its_group(kind, microbatches):
    schedule = _schedule(kind, 2, microbatches)
    config_for = _replicas(2, groups=["g0", "g1"]).early_reduce(schedule, lambda a: {"k": 1},
                                                                [schedule])
    last = last_actions(schedule)
    for ops in schedule.device_ops:
        for action in ops:
            config = config_for(action)
            assert config["k"] == 1
            if action == last[action.stage]:
                assert action.kind.value in ("W", "BW")
                assert config["reduce_group"] == f"g{action.stage}"
                fused = action.kind.value == "BW"  # its pass makes the last layers' first
                assert config["reduce_order"] == ("reverse" if fused else "forward")
            else:
                assert "reduce_group" not in config and "reduce_order" not in config


@pytest.mark.parametrize("groups, kind, shard", [
    (["g0", "g1"], "zb-v", None),  # two stages a device: their order may differ by replica
    (["g0", "g1"], "1f1b", "fsdp"),  # FSDP reduce-scatters in its reduce_grads
    ([], "1f1b", None),  # the simulator: no groups, the all-reduce is modelled
])
def test_no_op_starts_the_all_reduce_where_it_stays_in_reduce_grads(groups, kind, shard):
    schedule = _schedule(kind, 2)

    def config_for(action):
        return {"k": 1}

    assert _replicas(2, groups=groups, shard=shard).early_reduce(schedule, config_for,
                                                                 [schedule]) is config_for


def test_one_order_a_stage_for_every_replica():
    """Reverse only where every replica's last action of the stage is a fused BW: a replica
    with fewer microbatches must start the same buckets in the same order."""
    fused, split = _schedule("1f1b", 2), _schedule("zb-h1", 2)
    assert reduce_orders([fused, fused]) == {0: "reverse", 1: "reverse"}
    assert reduce_orders([split]) == {0: "forward", 1: "forward"}
    assert reduce_orders([fused, split]) == {0: "forward", 1: "forward"}
    config_for = _replicas(2, groups=["g0", "g1"]).early_reduce(fused, lambda a: {}, [fused, split])
    assert {config_for(a)["reduce_order"] for a in last_actions(fused).values()} == {"forward"}
