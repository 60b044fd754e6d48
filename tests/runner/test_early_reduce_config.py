"""Which ops start a stage's all-reduce [Note: all-reduce in the last W in
executors/torch/train/replicas.py]: each stage's last W (or BW) of a replica's schedule, told
its device's replica group and the order its buckets start in (last first after a fused BW,
for every replica); on a device holding two stages (ZB-V) only where every replica ends them in
one order; under FSDP told so (its reduce-scatter starts there once the stage is cut); nothing
on the simulator."""

from __future__ import annotations

import attrs
import pytest

from flowkit.dsl import Model
from flowkit.planner import Costs
from flowkit.planner.schedules import build_schedule
from flowkit.planner.simcosts import SimCosts
from flowkit.runner.replicas import (
    Replicas,
    agreed_devices,
    finish_order,
    last_actions,
    reduce_orders,
)
from flowkit.runner.training_tasks import submit_optimizer_step


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
    ([], "1f1b", None),  # the simulator: no groups, the all-reduce is modelled
])
def test_no_op_starts_the_all_reduce_where_it_stays_in_reduce_grads(groups, kind, shard):
    schedule = _schedule(kind, 2)

    def config_for(action):
        return {"k": 1}

    assert _replicas(2, groups=groups, shard=shard).early_reduce(schedule, config_for,
                                                                 [schedule]) is config_for


def test_an_fsdp_stages_last_w_is_told_to_start_its_reduce_scatter():
    schedule = _schedule("1f1b", 2)
    config_for = _replicas(2, groups=["g0", "g1"], shard="fsdp").early_reduce(
        schedule, lambda a: {}, [schedule])
    told = [config_for(a) for a in last_actions(schedule).values()]
    assert [c["shard"] for c in told] == ["fsdp", "fsdp"]
    assert sorted(c["reduce_group"] for c in told) == ["g0", "g1"]


def test_one_order_a_stage_for_every_replica():
    """Reverse only where every replica's last action of the stage is a fused BW: a replica
    with fewer microbatches must start the same buckets in the same order."""
    fused, split = _schedule("1f1b", 2), _schedule("zb-h1", 2)
    assert reduce_orders([fused, fused]) == {0: "reverse", 1: "reverse"}
    assert reduce_orders([split]) == {0: "forward", 1: "forward"}
    assert reduce_orders([fused, split]) == {0: "forward", 1: "forward"}
    config_for = _replicas(2, groups=["g0", "g1"]).early_reduce(fused, lambda a: {}, [fused, split])
    assert {config_for(a)["reduce_order"] for a in last_actions(fused).values()} == {"forward"}


@pytest.mark.parametrize("microbatches", [(4, 4), (3, 2), (1, 1)])
def test_a_v_schedules_two_stages_a_device_start_their_all_reduce_over_its_group(microbatches):
    """ZB-V ends the later stage of each device first, at every microbatch count: both stages'
    last W start their buckets over the device's one group, in that order on every replica."""
    schedules = [_schedule("zb-v", 2, m) for m in microbatches]
    assert [finish_order(schedules[0], d) for d in range(2)] == [(3, 0), (2, 1)]
    assert agreed_devices(schedules) == {0, 1}
    config_for = _replicas(2, groups=["g0", "g1"]).early_reduce(schedules[1], lambda a: {},
                                                                schedules)
    told = {a.stage: config_for(a)["reduce_group"] for a in last_actions(schedules[1]).values()}
    assert told == {0: "g0", 3: "g0", 1: "g1", 2: "g1"}


def _first_finisher_last(schedule, device: int):
    """`schedule` with the last action of the device's first-finished stage moved to its end."""
    ops = list(schedule.device_ops)
    moved = last_actions(schedule)[finish_order(schedule, device)[0]]
    ops[device] = (*[a for a in ops[device] if a != moved], moved)
    return attrs.evolve(schedule, device_ops=tuple(ops))


def test_a_device_whose_stages_replicas_end_in_other_orders_reduces_in_reduce_grads():
    plain = _schedule("zb-v", 2)
    swapped = _first_finisher_last(plain, 0)
    assert finish_order(swapped, 0) == (0, 3) and finish_order(plain, 0) == (3, 0)
    assert agreed_devices([plain, swapped]) == {1}
    config_for = _replicas(2, groups=["g0", "g1"]).early_reduce(plain, lambda a: {},
                                                                [plain, swapped])
    told = {a.stage for a in last_actions(plain).values() if "reduce_group" in config_for(a)}
    assert told == {1, 2}


class _Recorder:
    def __init__(self):
        self.ops = []

    def submit(self, op, *inputs, config, executor, **_):
        self.ops.append((op, config["stage"], executor))
        return object() if op != "grad_stats" else (object(), object())


@pytest.mark.parametrize("kind, order", [("zb-v", [(3, "e0"), (0, "e0")]),
                                         ("1f1b", [(0, "e0")])])
def test_reduce_grads_follow_each_devices_finish_order(kind, order):
    """A replica with no microbatch starts a device's collectives in reduce_grads: in the
    order the other replicas' last W's started them."""
    schedule = _schedule(kind, 2)
    recorder = _Recorder()
    executors = [attrs.make_class("E", ["id"])(f"e{d}") for d in range(2)]
    submit_optimizer_step(recorder, schedule, executors, {}, [], {}, lane="m", meta={},
                          outputs=1, reduce=lambda stage: ([], {}))
    reduces = [(stage, e) for op, stage, e in recorder.ops if op == "reduce_grads"]
    assert [r for r in reduces if r[1] == "e0"] == order
