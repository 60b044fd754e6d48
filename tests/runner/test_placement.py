"""Placement (`RunConfig.placement`, `flowkit run --placement`): which executors carry which
tags when the user gives no --tags. colocated: every executor every tag; disaggregated: as many
executors as training needs carry training's tags and the rest the other ops'; multiplexed: the
same, with the training executors carrying the others' tags too, so that their idle time
generates. Bad settings fail before anything starts, naming the fix."""

from __future__ import annotations

import json

import pytest

from benchmarks.runs import bench_run
from dataflows.grpo import grpo_flow
from dataflows.pretrain import pretrain_flow
from flowkit.planner.lower import lower_flow
from flowkit.runner.config import RunConfig, RunConfigError
from flowkit.runner.setup import executor_tags


def _grpo(stages: int = 2):
    return lower_flow(grpo_flow(prompts=4, n=4, stages=stages, microbatches=2,
                                max_new_tokens=8))


def test_colocated_gives_every_executor_every_tag_as_without_a_placement():
    plan = _grpo()
    assert executor_tags(plan, 3, None, "colocated") == executor_tags(plan, 3, None) \
        == [("rollout", "train")] * 3


def test_disaggregated_splits_training_from_the_rest_and_multiplexed_lends_it_their_tags():
    plan = _grpo(stages=2)
    assert executor_tags(plan, 4, None, "disaggregated") == [("train",)] * 2 + [("rollout",)] * 2
    assert executor_tags(plan, 3, None, "multiplexed") == \
        [("rollout", "train")] * 2 + [("rollout",)]


def test_a_split_placement_needs_an_executor_beyond_training_and_ops_beyond_it():
    with pytest.raises(RunConfigError, match="--num-executors 3"):
        executor_tags(_grpo(stages=2), 2, None, "disaggregated")
    pretrain = lower_flow(pretrain_flow(corpus="examples/data/corpus.txt", stages=2))
    with pytest.raises(RunConfigError, match="colocated"):
        executor_tags(pretrain, 4, None, "multiplexed")


def test_a_placement_and_tags_together_or_an_unknown_one_are_refused():
    with pytest.raises(RunConfigError, match="placement"):
        RunConfig(placement="spread")
    with pytest.raises(RunConfigError, match="--tags"):
        RunConfig(placement="disaggregated", tags=(("train",), ("rollout",)))


@pytest.mark.slow
def test_a_split_run_starts_twice_trainings_executors_by_default_and_multiplexed_ones_generate(
        tmp_path):
    trace = tmp_path / "t.json"
    flow = grpo_flow(prompts=4, n=4, stages=2, microbatches=2, max_new_tokens=8)
    with bench_run(flow, executors="sim", steps=2, placement="multiplexed",
                   trace=trace) as run:
        list(run.steps())
        tags = {e.name: e.tags for e in run.executors}
    assert sorted(map(sorted, tags.values())) == [["rollout"]] * 2 + [["rollout", "train"]] * 2
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    generators = {e["pid"] for e in spans if e["args"].get("node") == "generate"}
    trainers = {e["pid"] for e in spans if e["args"].get("node") == "update_actor"}
    assert trainers and trainers <= generators  # the training executors generated too


@pytest.mark.slow
def test_multiplexed_torch_executors_generate_with_the_newest_weights(tmp_path):
    """A training executor lent to generation holds a whole copy of the actor, synced with the
    rollout executors': in a synchronous run every sample of step s, wherever it was generated,
    has every token from the weights of step s (the initial ones at step 0)."""
    trace = tmp_path / "t.json"
    flow = grpo_flow(prompts=4, n=4, stages=2, microbatches=2, max_new_tokens=4)
    with bench_run(flow, executors="torch", steps=3, placement="multiplexed",
                   num_executors=3, trace=trace) as run:
        list(run.steps())
        trainers = {e.id for e in run.executors if "train" in e.tags}
    spans = [e for e in json.loads(trace.read_text())["traceEvents"]
             if e["ph"] == "X" and e["args"].get("node") == "generate"]
    assert {span["pid"] for span in spans} & trainers  # some on the training executors
    for span in spans:
        step = span["args"]["step"]
        for _, _, first, last, _ in span["args"]["items"]:
            assert (first, last) == ((-1, -1) if step == 0 else (step, step)), span["pid"]
