"""StreamedSchedule's contract, for any schedule and any order in which microbatches form: each
device's actions are submitted in the schedule's order, every action after the actions it reads,
no forward that reads data before its microbatch is fed, and all of them once all are fed."""

import contextlib

from hypothesis import given, settings
from hypothesis import strategies as st

from flowkit.planner import Action, Costs, Kind
from flowkit.planner.schedules import build_schedule
from flowkit.planner.simulate import dependencies
from flowkit.runner.pipeline import StreamedSchedule
from flowkit.runtime.registry import ExecutorInfo

KINDS = ["gpipe", "1f1b", "zb-h1", "zb-h2", "zb-v"]


class RecordingController:
    """Stands in for the controller's submission interface only: records what is submitted
    (the pipeline's ordering logic is what is under test; real runs are in test_pipeline.py)."""

    def __init__(self) -> None:
        self.submitted: list[tuple] = []

    def batch(self):
        return contextlib.nullcontext()

    def submit(self, op, *inputs, config, executor, lane, meta):
        future = object()
        self.submitted.append((executor, Action.parse(meta["action"]), inputs, future))
        return future


def _executors(n: int) -> list[ExecutorInfo]:
    return [ExecutorInfo(id=i, name=f"e{i}", tags=(), ops=frozenset(), pid=0, host="",
                         device="cpu", peer_address="", identity=b"") for i in range(n)]


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(KINDS), devices=st.integers(2, 4), microbatches=st.integers(1, 8),
       data=st.data())
def test_actions_go_out_in_order_and_only_once_their_microbatch_has_formed(
        kind, devices, microbatches, data):
    schedule = build_schedule(kind, devices=devices, microbatches=microbatches,
                              costs=Costs.uniform(devices))
    ctl = RecordingController()
    streamed = StreamedSchedule(ctl, schedule, _executors(devices))
    feeding = data.draw(st.permutations(range(microbatches)))
    fed: set[int] = set()
    last = schedule.num_stages - 1
    for mb in feeding:
        streamed.feed(mb, (f"data{mb}",))
        fed.add(mb)
        before = len(ctl.submitted)
        streamed.advance()
        for _, action, inputs, _ in ctl.submitted[before:]:
            if action.kind is Kind.F and action.stage in (0, last):
                assert action.microbatch in fed and f"data{action.microbatch}" in inputs
    assert streamed.done and len(streamed.run.losses) == microbatches
    order = [action for _, action, _, _ in ctl.submitted]
    assert sorted(map(str, order)) == sorted(str(a) for ops in schedule.device_ops for a in ops)
    for device, ops in enumerate(schedule.device_ops):
        assert [a for e, a, _, _ in ctl.submitted if e == device] == list(ops)
    position = {(a.stage, "B" if a.kind in (Kind.B, Kind.BW) else a.kind.value, a.microbatch): i
                for i, a in enumerate(order)}
    for i, action in enumerate(order):
        for stage, kind, mb in dependencies(action, schedule.num_stages):
            assert position[(stage, "B" if kind is None else kind.value, mb)] < i
