"""group_by(..., second_round=k, second_round_budget=B) [Note: second rounds in
flowkit/runner/second_round.py]: the group's op runs as soon as a prompt's first samples are in;
a group it yields nothing for gets k more samples of its prompt, numbered on from the first,
while the step's budget lasts, and the op runs again on all of them. A flow that cannot sample
again (stage by stage among them) is refused before anything starts. On executor processes."""

from __future__ import annotations

import pytest

from flowkit import RunConfig
from flowkit.dsl import Flow, collect, group_by
from tests.harness import pooled_run
from tests.runner.quota_ops import (
    differing,
    drawn,
    drawn_plain,
    judged,
    kept_samples,
    keyed_prompts,
    numbered_prompts,
    slow_prompts,
    three_of,
)


def _flow(*, prompts: int = 6, more: int = 2, budget: int | None = None,
          judge: bool = True, source=numbered_prompts) -> Flow:
    with Flow("again") as flow:
        samples = drawn(source(prompts=prompts))
        samples = judged(samples) if judge else samples
        kept_samples(collect(differing(group_by(samples, key="prompt_id", second_round=more,
                                                second_round_budget=budget))))
    return flow


def _lines(pool, flow: Flow, **settings) -> list[dict]:
    config = {"steps": 2, "executors": "base", "dashboard": False, **settings}
    return pooled_run(pool, flow, RunConfig(**config)).records


def _kept(line: dict) -> dict[str, str]:
    return {key.split("/")[1]: value for key, value in line.items() if key.startswith("kept/")}


@pytest.mark.parametrize("source", [numbered_prompts, slow_prompts], ids=["at_once", "streaming"])
def test_groups_that_agree_are_sampled_again_and_trained_on_all_their_samples(pool, source):
    """Prompts 0 and 3 differ in their first samples; 1 and 5 with their fourth, drawn in the
    second round; 2 and 4 agree in both rounds and are dropped. From a source still streaming
    its prompts, the later ones are sampled again as well."""
    for line in _lines(pool, _flow(source=source)):
        assert _kept(line) == {"0": "0,1,2", "3": "0,1,2", "1": "0,1,2,3,4",
                               "5": "0,1,2,3,4"}
        assert line["drawn/second_rounds"] == 4  # prompts 1, 2, 4 and 5
        assert line["drawn/second_round_samples"] == 8
        assert line["differing/second_round_kept"] == 2
        assert line["differing/second_round_denied"] == 0


def test_a_budget_bounds_the_second_rounds_of_a_step(pool):
    """3 samples of budget: one round of 2 and one of 1; the other two groups that agree are
    dropped as they are."""
    for line in _lines(pool, _flow(budget=3)):
        assert line["drawn/second_rounds"] == 2
        assert line["drawn/second_round_samples"] == 3
        assert line["differing/second_round_denied"] == 2
        kept = _kept(line)
        assert kept["0"] == kept["3"] == "0,1,2"
        assert set(kept) - {"0", "3"} <= {"1", "5"}  # a fourth sample (3) decides them
        for prompt in set(kept) - {"0", "3"}:
            assert kept[prompt] in ("0,1,2,3", "0,1,2,3,4")


def test_no_budget_no_second_round(pool):
    for line in _lines(pool, _flow(budget=0)):
        assert _kept(line) == {"0": "0,1,2", "3": "0,1,2"}
        assert (line["drawn/second_rounds"], line["differing/second_round_denied"]) == (0, 4)


def test_stage_by_stage_a_second_round_is_refused_before_the_run(pool):
    with pytest.raises(Exception, match=r"differing: group_by\(..., second_round=\) samples a "
                       "group again while its step generates, and stage by stage"):
        _lines(pool, _flow(), fuse=False)


def test_second_round_settings_that_cannot_work_are_refused_when_the_flow_is_built():
    cases = [
        (dict(size=3, second_round=2), r"size=3, second_round=2\): a second round grows"),
        (dict(take=2, second_round=2), r"take=2, second_round=2\): a quota of groups"),
        (dict(second_round=0), r"group_by\(second_round=0\): a whole number >= 1"),
        (dict(second_round_budget=4), r"second_round_budget=4\): .* with second_round"),
        (dict(second_round=2, second_round_budget=-1), r"second_round_budget=-1"),
    ]
    for settings, message in cases:
        with pytest.raises(ValueError, match=message), Flow("bad"):
            group_by(drawn(numbered_prompts(prompts=2)), key="prompt_id", **settings)


def test_a_flow_that_cannot_sample_a_group_again_is_refused_before_it_starts(pool):
    with Flow("bare") as bare:
        kept_samples(collect(differing(group_by(numbered_prompts(prompts=4), key="prompt_id",
                                                second_round=2))))
    with pytest.raises(Exception, match="no per-item op feeds it"):
        _lines(pool, bare)
    with Flow("fan") as fan:  # three_of yields a Stream between generation and the groups
        samples = three_of(drawn(numbered_prompts(prompts=4)))
        kept_samples(collect(differing(group_by(samples, key="prompt_id", second_round=2))))
    with pytest.raises(Exception, match="one item per call from each op between 'drawn'"):
        _lines(pool, fan)
    with Flow("single") as single:  # generation makes one item a call
        kept_samples(collect(differing(group_by(judged(numbered_prompts(prompts=4)),
                                                key="prompt_id", second_round=2))))
    with pytest.raises(Exception, match="with 'judged', which makes one item a call"):
        _lines(pool, single)
    with Flow("plain") as plain:  # generation cannot be told a later round's first sample
        kept_samples(collect(differing(group_by(judged(drawn_plain(numbered_prompts())),
                                                key="prompt_id", second_round=2))))
    with pytest.raises(Exception, match="'drawn_plain' a later round's n and first_sample"):
        _lines(pool, plain)


def test_two_prompts_of_a_step_with_one_key_are_refused(pool):
    """Two prompts with one prompt_id: their samples would meet in one group."""
    with Flow("twice") as flow:
        samples = judged(drawn(keyed_prompts(groups=1, size=2)))
        kept_samples(collect(differing(group_by(samples, key="prompt_id", second_round=2))))
    with pytest.raises(Exception, match="share the key 0: give each prompt of a step its own"):
        _lines(pool, flow, steps=1)
