"""group_by(..., take=T, rounds=R) [Note: sampling rounds in flowkit/runner/sampling_rounds.py]: the
source makes R rounds of prompts, the first per-item op after it calls a round at a time, the
next one only while the groups still to come cannot fill the quota; the step takes exactly T
groups when the rounds allow it, counts the rounds run and the prompts never called, and a flow
that cannot sample in rounds is refused before anything starts. On executor processes."""

from __future__ import annotations

import pytest

from flowkit import RunConfig
from flowkit.dsl import Flow, collect, group_by
from tests.harness import pooled_run
from tests.runner.quota_ops import keep_odd, kept, numbered_prompts, three_of


def _flow(*, prompts: int, take: int, rounds: int | None) -> Flow:
    with Flow("rounds") as flow:
        samples = three_of(numbered_prompts(prompts=prompts))
        kept(collect(keep_odd(group_by(samples, key="prompt_id", size=3, take=take,
                                       rounds=rounds))))
    return flow


def _lines(pool, flow: Flow, **settings) -> list[dict]:
    config = {"steps": 2, "executors": "base", "dashboard": False, **settings}
    return pooled_run(pool, flow, RunConfig(**config)).records


@pytest.mark.parametrize(("prompts", "take", "rounds", "taken", "ran", "unused"), [
    (12, 3, 3, 3, 2, 4),  # round 1 (ids 0-3) yields 1 and 3; round 2 fills the quota
    (12, 2, 3, 2, 1, 8),  # round 1 is enough: rounds 2 and 3 never run
    (8, 5, 2, 4, 2, 0),  # both rounds run and the step is one group short
])
def test_rounds_run_until_the_quota_fills(pool, prompts, take, rounds, taken, ran, unused):
    for line in _lines(pool, _flow(prompts=prompts, take=take, rounds=rounds)):
        assert (line["kept/groups"], line["kept/items"]) == (taken, 3 * taken)
        assert line["keep_odd/groups_taken"] == taken
        assert line["keep_odd/groups_short"] == max(0, take - taken)
        assert line["three_of/sampling_rounds"] == ran
        assert line["three_of/prompts_unused"] == unused


def test_stage_by_stage_a_step_runs_its_first_round_only(pool):
    for line in _lines(pool, _flow(prompts=12, take=3, rounds=3), fuse=False):
        assert line["kept/groups"] == 2 and line["keep_odd/groups_short"] == 1
        assert (line["three_of/sampling_rounds"], line["three_of/prompts_unused"]) == (1, 8)


def test_rounds_need_a_take():
    with pytest.raises(ValueError, match=r"rounds=2\) calls the prompts in rounds until `take`"):
        _flow(prompts=4, take=None, rounds=2)
    with pytest.raises(ValueError, match=r"group_by\(rounds=0\)"):
        _flow(prompts=4, take=2, rounds=0)


def test_rounds_need_a_per_item_op_between_the_source_and_the_groups(pool):
    with Flow("bare") as flow:
        kept(collect(keep_odd(group_by(numbered_prompts(prompts=4), key="prompt_id", size=1,
                                       take=2, rounds=2))))
    with pytest.raises(Exception, match="no per-item op feeds it"):
        _lines(pool, flow)
