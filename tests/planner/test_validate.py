"""validate(): every problem named, the grid printed with the offending actions in brackets."""

import pytest

from flowkit.planner import Action, Costs, MemoryModel, Placement, Schedule, ScheduleError
from flowkit.planner.schedules import build_schedule
from flowkit.planner.validate import render_grid, validate


def _schedule(*device_texts: str, microbatches=2, stage_to_device=None) -> Schedule:
    ops = [[Action.parse(t) for t in text.split()] for text in device_texts]
    return Schedule(
        kind="hand",
        placement=Placement(stage_to_device or range(len(ops))),
        microbatches=microbatches,
        device_ops=ops,
    )


GOOD = ("0F0 0F1 0B0 0W0 0B1 0W1", "1F0 1B0 1F1 1B1 1W0 1W1")


def _error(schedule, **kwargs) -> ScheduleError:
    with pytest.raises(ScheduleError) as err:
        validate(schedule, Costs.uniform(schedule.num_stages), **kwargs)
    return err.value


def test_good_schedule_returns_its_simulation():
    result = validate(_schedule(*GOOD), Costs.uniform(2))
    assert result.makespan > 0


def test_missing_w_marks_its_b():
    err = _error(_schedule("0F0 0F1 0B0 0W0 0B1", GOOD[1]))
    assert "stage 0 microbatch 1 has no W for its B" in str(err)
    assert "[0B1]" in str(err) and Action(0, "B", 1) in err.marked
    assert "step | dev 0" in str(err)


def test_duplicate_f_is_marked():
    err = _error(_schedule("0F0 0F1 0F1 0B0 0W0 0B1 0W1", GOOD[1]))
    assert "0F1 appears 2 times" in str(err)
    assert str(err).count("[0F1]") == 2  # both copies are bracketed


def test_wrong_device_is_marked():
    err = _error(_schedule("0F0 0F1 0B0 0W0 0B1 0W1 1W1", "1F0 1B0 1F1 1B1 1W0"))
    assert "1W1 is on device 0, but stage 1 lives on device 1" in str(err)
    assert "[1W1]" in str(err)


def test_memory_over_limit_marks_the_first_action_over():
    err = _error(_schedule(*GOOD), memory_limit=1.5)
    assert "device 0 peaks at 2 > memory limit 1.5 (first over after 0F1)" in str(err)
    assert "[0F1]" in str(err)


def test_memory_limit_uses_the_model():
    lean = MemoryModel(F=0.5, B=-0.25, W=-0.25, BW=-0.5)
    validate(_schedule(*GOOD), Costs.uniform(2), lean, memory_limit=1.0)


def test_deadlock_is_shown_on_the_grid():
    err = _error(_schedule("0F1 0B0 0W0 0F0 0B1 0W1", "1F0 1B0 1W0 1F1 1B1 1W1"))
    assert "deadlock" in str(err)
    assert "[0B0]" in str(err) and "[1F0]" in str(err)


def test_several_problems_are_listed_together():
    err = _error(_schedule("0F0 0B0 0W0", "1F0 1F1 1B0 1W0"))
    assert "errors:" in str(err) and len(err.problems) >= 2


def test_long_grids_show_rows_around_marks():
    ops = " ".join(f"0F{i} 0BW{i}" for i in range(60))
    grid = render_grid(_schedule(ops, microbatches=60), {Action(0, "F", 3)})
    assert "[0F3]" in grid and "..." in grid and "(120 steps)" in grid
    assert len(grid.splitlines()) < 30


def test_validate_marks_a_memory_only_failure():
    with pytest.raises(ScheduleError) as raised:
        build_schedule("gpipe", devices=4, microbatches=8, costs=Costs.uniform(4), memory_limit=4)
    assert raised.value.over_memory
    with pytest.raises(ScheduleError) as raised:
        build_schedule("zb-v", devices=4, microbatches=8, costs=Costs.uniform(4),
                       memory=MemoryModel(B=0, W=0, BW=0))
    assert raised.value.over_memory
