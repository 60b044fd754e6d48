"""The registry: names, chunk handling, input errors, validation of every builder's output."""

import pytest

from flowkit.planner import Action, Costs, Placement, Schedule, ScheduleError
from flowkit.planner.schedules import build_schedule, get_spec, register, schedule_kinds
from flowkit.planner.schedules import registry as registry_module


def test_handcrafted_kinds_are_registered():
    assert {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2"} <= set(schedule_kinds())
    assert get_spec("zb-h1").summary.startswith("ZB-H1")


def test_unknown_kind_names_the_known_ones():
    with pytest.raises(ValueError, match="known kinds: .*1f1b"):
        build_schedule("nope", devices=2, microbatches=2, costs=Costs.uniform(2))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"devices": 3}, "costs are given for 2 device shares"),
        ({"microbatches": 0}, "must be >= 1"),
        ({"chunks": 2}, "supports chunks = 1"),
    ],
)
def test_bad_inputs_are_value_errors(kwargs, match):
    args = {"devices": 2, "microbatches": 4, "costs": Costs.uniform(2), **kwargs}
    with pytest.raises(ValueError, match=match):
        build_schedule("1f1b", **args)


def test_chunked_kind_defaults_and_accepts_chunks():
    costs = Costs.uniform(2)
    assert (
        build_schedule("interleaved-1f1b", devices=2, microbatches=4, costs=costs).placement.chunks
        == 2
    )
    assert (
        build_schedule(
            "interleaved-1f1b", devices=2, microbatches=4, costs=costs, chunks=3
        ).placement.chunks
        == 3
    )


def test_a_broken_builder_is_caught_by_validation(monkeypatch):
    monkeypatch.setattr(registry_module, "_REGISTRY", dict(registry_module._REGISTRY))

    @register("broken-for-test")
    def broken(request):
        """Forgets every W."""
        ops = [[Action(0, "F", 0), Action(0, "B", 0)]]
        return Schedule(
            kind=request.kind, placement=Placement.one_per_device(1), microbatches=1, device_ops=ops
        )

    with pytest.raises(ScheduleError, match=r"no W for its B[\s\S]*\[0B0\]"):
        build_schedule("broken-for-test", devices=1, microbatches=1, costs=Costs.uniform(1))


def test_memory_limit_below_a_kinds_peak_fails_validation():
    with pytest.raises(ScheduleError, match="memory limit 3"):
        build_schedule("1f1b", devices=4, microbatches=8, costs=Costs.uniform(4), memory_limit=3)


def test_duplicate_registration_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        register("1f1b")(lambda request: None)
