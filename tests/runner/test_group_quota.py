"""group_by(..., take=T) [Note: group quota in flowkit/runner/quota.py]: of the groups its
per-group consumer yields items for, the step takes the first T; the groups it yields nothing
for and those after the T-th go no further, each counted; a flow that misuses it is refused
before anything starts. On executor processes, fused and stage by stage."""

from __future__ import annotations

import pytest

from flowkit import RunConfig
from flowkit.dsl import Flow, FlowError, collect, group_by
from tests.harness import pooled_run
from tests.runner.quota_ops import keep_odd, kept, keyed_prompts


def _flow(take: int | None, groups: int = 6) -> Flow:
    with Flow("quota") as flow:
        prompts = keyed_prompts(groups=groups, size=3)
        kept(collect(keep_odd(group_by(prompts, key="prompt_id", size=3, take=take))))
    return flow


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("take, taken, surplus, short", [(2, 2, 1, 0), (3, 3, 0, 0),
                                                         (5, 3, 0, 2)])
def test_the_step_takes_the_first_groups_that_yield(pool, fuse, take, taken, surplus, short):
    result = pooled_run(pool, _flow(take), RunConfig(steps=2, executors="base",
                                                     dashboard=False, fuse=fuse))
    for line in result.records:  # 6 groups of 3: the odd three yield, the even three do not
        assert (line["kept/groups"], line["kept/items"]) == (taken, 3 * taken)
        assert line["keep_odd/groups_taken"] == taken
        assert line["keep_odd/groups_empty"] == 3
        assert line["keep_odd/groups_surplus"] == surplus
        assert line["keep_odd/groups_short"] == short


def test_without_take_every_group_goes_on(pool):
    result = pooled_run(pool, _flow(None), RunConfig(steps=1, executors="base",
                                                     dashboard=False))
    (line,) = result.records
    assert line["kept/groups"] == 3 and "keep_odd/groups_taken" not in line


def test_take_must_be_a_whole_number():
    with pytest.raises(ValueError, match=r"take=0"):
        _flow(0)


def test_take_needs_a_consumer_that_yields_a_stream():
    with pytest.raises(FlowError) as raised:
        with Flow("bad"):
            kept(group_by(keyed_prompts(), key="prompt_id", size=3, take=2))
    assert any(p.rule == "group-take" for p in raised.value.problems)
