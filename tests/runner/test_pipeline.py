"""Pipeline schedules from the planner run on simulator executor processes."""

import pytest

from flowkit.planner import Action, Costs, Kind, Schedule
from flowkit.planner.schedules import build_schedule
from flowkit.runner.pipeline import _Cursor, stage_costs_config, submit_schedule

P, M = 3, 6


# The order the pipeline's cursor submits a whole schedule in, as the runner's submit_schedule and
# StreamedSchedule walk it: only this test asks for it as a list, so it lives here.
def submission_order(schedule: Schedule) -> list[tuple[int, Action]]:
    """(device, action) in an order that keeps each device's order and submits every action
    after the actions it reads from, so their futures exist when it is submitted."""
    order: list[tuple[int, Action]] = []
    cursor = _Cursor(schedule)
    cursor.advance(lambda device, action: order.append((device, action)) or True)
    if not cursor.done:
        raise ValueError(f"schedule {schedule.kind!r} deadlocks: validate it with the planner")
    return order


@pytest.fixture(scope="module")
def sims(pool):
    with pool.shared(P, kind="sim", name_prefix="sim") as started:
        yield started


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1", "zb-h2", "gpipe"])
def test_submission_order_keeps_device_order_and_dependencies(kind):
    costs = Costs.uniform(P)
    schedule = build_schedule(kind, devices=P, microbatches=M, costs=costs)
    order = submission_order(schedule)
    for device, ops in enumerate(schedule.device_ops):
        assert [a for d, a in order if d == device] == list(ops)
    position = {a: i for i, (_, a) in enumerate(order)}
    for action, i in position.items():
        if action.kind is Kind.F and action.stage > 0:
            assert position[Action(action.stage - 1, Kind.F, action.microbatch)] < i


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1", "interleaved-1f1b"])
def test_a_schedule_runs_every_action_once_in_each_devices_order(sims, kind):
    ctl, infos = sims
    costs = Costs.uniform(P, F=0.002, B=0.002, W=0.001)
    schedule = build_schedule(kind, devices=P, microbatches=M, costs=costs)
    stage_costs = costs.for_placement(schedule.placement)
    run = submit_schedule(ctl, schedule, infos,
                          config_for=stage_costs_config(stage_costs, activation_bytes=4096))
    run.wait(timeout=30)
    assert len(run.futures) == sum(len(ops) for ops in schedule.device_ops)
    for device, ops in enumerate(schedule.device_ops):
        starts = [run.futures[a].timing[0] for a in ops]
        assert starts == sorted(starts), f"device {device} ran out of schedule order"
        assert {run.futures[a].location for a in ops} == {infos[device].id}
    losses = [f.result(timeout=5) for f in run.losses]
    assert len(losses) == M and all(loss.loss > 0 for loss in losses)
    measured = run.measured()
    assert measured["makespan"] > 0 and 0 <= measured["bubble_rate"] < 1


@pytest.mark.parametrize(("kind", "fused"), [("1f1b", True), ("zb-h1", False)])
def test_a_forward_is_told_when_its_backward_is_one_bw(sims, kind, fused):
    """[Note: a fused backward in executors/torch/train/stage.py]: 1F1B's forwards need not record
    for a W of their own; a zero-bubble schedule's must."""
    ctl, infos = sims
    told = []

    def listener(event, payload):
        if event == "task_submitted" and payload["task"].op == "F":
            told.append(payload["task"].config.get("fused_backward", False))

    costs = Costs.uniform(P, F=1e-4, B=1e-4, W=1e-4)
    schedule = build_schedule(kind, devices=P, microbatches=M, costs=costs)
    ctl.add_listener(listener)
    try:
        submit_schedule(ctl, schedule, infos,
                        config_for=stage_costs_config(costs)).wait(timeout=30)
    finally:
        ctl.remove_listener(listener)
    assert told == [fused] * (P * M)


def test_a_failing_stage_fails_everything_downstream_and_nothing_hangs(sims):
    ctl, infos = sims
    costs = Costs.uniform(P, F=0.001, B=0.001, W=0.001)
    schedule = build_schedule("1f1b", devices=P, microbatches=M, costs=costs)

    def config_for(action):
        config = stage_costs_config(costs)(action)
        if action == Action(1, Kind.F, 2):
            config["seconds"] = "not a number"  # the op raises on the executor
        return config

    run = submit_schedule(ctl, schedule, infos, config_for=config_for)
    with pytest.raises(Exception, match="1F2|not a number|could not convert"):
        run.wait(timeout=30)
    assert run.futures[Action(2, Kind.F, 2)].exception(timeout=5) is not None
    assert run.futures[Action(0, Kind.F, 0)].exception(timeout=5) is None


@pytest.mark.parametrize("kind", ["zb-h1", "zb-h2"])
def test_a_split_schedule_on_one_device_and_one_replica_runs_fused_backwards(kind):
    """[Note: one device, one backward]: nothing for a separate W to fill or start early; on
    two devices, or with replicas (W's all-reduce may start before the end), W stays apart."""
    from types import SimpleNamespace

    from flowkit.runner.trainschedule import TrainingSchedules

    def kinds(devices: int, replicas: int) -> tuple[str, set[Kind]]:
        planning = TrainingSchedules(SimpleNamespace(replicas=replicas))
        schedule = planning.schedule(kind, devices, 4, Costs.uniform(devices), None)
        return schedule.kind, {a.kind for ops in schedule.device_ops for a in ops}

    assert kinds(1, 1) == ("1f1b", {Kind.F, Kind.BW})
    assert Kind.W in kinds(1, 2)[1] and Kind.W in kinds(2, 1)[1]
