"""Action text, placements and costs of the planner IR."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowkit.planner import Action, Costs, Kind, MemoryModel, Placement

actions = st.builds(
    Action, st.integers(0, 10_000), st.sampled_from(list(Kind)), st.integers(0, 10_000)
)


@given(actions)
def test_action_text_round_trips(action):
    assert Action.parse(str(action)) == action


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("2F0", Action(2, Kind.F, 0)),
        ("3BW7", Action(3, Kind.BW, 7)),
        (" 0W12 ", Action(0, Kind.W, 12)),
    ],
)
def test_action_parses_known_forms(text, action):
    assert Action.parse(text) == action


@pytest.mark.parametrize("text", ["", "F0", "2X0", "2F", "-1F0", "2FW0", "2 F 0", "2f0"])
def test_action_parse_rejects_bad_text(text):
    with pytest.raises(ValueError, match="cannot parse action"):
        Action.parse(text)


def test_placements():
    assert Placement.one_per_device(3).stage_to_device == (0, 1, 2)
    interleaved = Placement.interleaved(3, 2)
    assert interleaved.stage_to_device == (0, 1, 2, 0, 1, 2)
    assert interleaved.chunks == 2 and interleaved.stages_on(1) == (1, 4)
    v = Placement.vshape(3)
    assert v.stage_to_device == (0, 1, 2, 2, 1, 0)
    assert v.num_devices == 3 and v.num_stages == 6 and v.device_of(5) == 0


@pytest.mark.parametrize("stage_to_device", [(), (1, 2), (0, 2)])
def test_placement_rejects_gaps(stage_to_device):
    with pytest.raises(ValueError):
        Placement(stage_to_device)


def test_costs_for_placement_divides_each_share_by_chunks():
    shares = Costs(F=[1, 2], B=[2, 4], W=[1, 1], comm=0.5)
    per_stage = shares.for_placement(Placement.interleaved(2, 2))
    assert per_stage.F == (0.5, 1.0, 0.5, 1.0)
    assert per_stage.B == (1.0, 2.0, 1.0, 2.0)
    assert per_stage.comm == 0.5
    with pytest.raises(ValueError, match="3 devices"):
        shares.for_placement(Placement.one_per_device(3))


def test_costs_reject_negative_and_ragged():
    with pytest.raises(ValueError, match="non-negative"):
        Costs(F=[-1], B=[1], W=[1])
    with pytest.raises(ValueError, match="one cost per stage"):
        Costs(F=[1, 1], B=[1], W=[1])


def test_memory_model_scales_by_chunks():
    memory = MemoryModel()
    assert memory.delta(Action(0, Kind.F, 0)) == 1.0
    assert memory.delta(Action(0, Kind.BW, 0), chunks=2) == -0.5


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_costs_and_memory_refuse_non_finite_numbers(bad):
    with pytest.raises(ValueError, match="finite"):
        Costs(F=[1, bad], B=[1, 1], W=[1, 1])
    with pytest.raises(ValueError, match="finite"):
        Costs.uniform(2, comm=bad)
    with pytest.raises(ValueError, match="finite"):
        MemoryModel(B=bad)
