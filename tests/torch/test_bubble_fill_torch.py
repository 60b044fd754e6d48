"""Bubble filling on torch executors [Note: bubble filling in flowkit/runner/bubble_fill.py]: the
reference's log-probs, placed beside the engine, also run on the two training executors in
their pipeline's bubbles (the reference loaded whole there), and the actor trains to the same
parameters as when they run beside the engine only (float64, 1e-10). Which items a bubble
takes depends on timing on a tiny CPU model (tests/runner/test_bubble_fill.py checks the
sizing on the simulator); here every bubble is taken to hold whatever waits, so that some
scoring surely runs on the trainers on any machine."""

import attrs
import pytest
import torch

from dataflows.grpo import grpo_flow
from flowkit.planner.lower import lower_flow
from flowkit.runner import bubble_fill, stepbatching, steplending
from flowkit.runner.flowrun import FlowRunner
from tests.harness import tiny_gpt

TINY = {**tiny_gpt(), "dtype": "float64", "seed": 3}
STEPS = 3  # the first learns the scoring's cost; the later ones lend


def _train(pool, tmp_path, fill: bool):
    tags = [("train",), ("train",), ("rollout",)]
    flow = grpo_flow(prompts=8, n=4, stages=2, microbatches=2, max_new_tokens=6, lr=1e-2,
                     kl_coef=0.01, schedule="1f1b", gpt=TINY, reference_tags=("rollout",))
    flow.nodes["update_actor"].config["clip_ratio"] = 10.0  # every token's gradient kept
    with pool.shared(3, kind="torch", tags=tags) as (ctl, infos):
        trainers = {e.id for e in infos if "train" in e.tags}
        scored_on = []

        def listen(event, payload):
            task = payload.get("task")
            if event == "task_submitted" and (task.meta or {}).get("node") == "ref_logprobs":
                scored_on.append(payload["executor"].id in trainers)

        ctl.add_listener(listen)
        runner = FlowRunner(ctl, lower_flow(flow), fill_bubbles=fill)
        reports = [runner.run_step(step) for step in range(STEPS)]
        (path,) = runner.save_weights(tmp_path / ("filled" if fill else "apart"))
        ctl.remove_listener(listen)  # the executors go on to other tests
    return torch.load(path, weights_only=True), reports, scored_on


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pool):
    tmp = tmp_path_factory.mktemp("fill")
    with pytest.MonkeyPatch.context() as patch:
        # scoring tasks of one item, one at a time, so that the reference's items wait for the
        # rollout executor; every bubble a thousand times its planned length: it holds all
        # that waits once an item's cost is known
        patch.setattr(steplending, "_FILL_TASK_S", 1e-4)
        patch.setattr(stepbatching, "_BATCHES_IN_FLIGHT", 1)
        planned = bubble_fill.bubbles
        patch.setattr(bubble_fill, "bubbles", lambda result: [
            attrs.evolve(b, end=b.start + 1000 * b.length) for b in planned(result)])
        return {fill: _train(pool, tmp, fill) for fill in (False, True)}


def test_filled_scoring_trains_the_same_parameters(runs):
    apart, _, apart_on = runs[False]
    filled, reports, filled_on = runs[True]
    assert not any(apart_on)
    assert any(filled_on), "no reference log-probs ran in a trainer's bubble"
    assert sum(r.metrics["ref_logprobs/bubble_items"] for r in reports) > 0
    assert filled.keys() == apart.keys()
    for name in filled:
        torch.testing.assert_close(filled[name], apart[name], rtol=0, atol=1e-10,
                                   msg=f"{name} differs")
