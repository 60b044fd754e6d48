"""The reference in the actor's forward [Note: reference in the F in
executors/torch/train/rows.py]: GRPO with `reference_in_forward` trains the parameters of the
same run with the reference's log-probs scored by a LogProbs op, in float64, on a 2-stage
pipeline (the reference whole on the last stage's executor), on two replicas and with packed
rows; and no LogProbs op runs. Settings that cannot work are refused before anything starts."""

import attrs
import pytest
import torch

from dataflows.grpo import grpo_flow
from dataflows.model_ops import Backprop, LogProbs
from dataflows.models import reference_of
from dataflows.rloo import rloo_flow
from flowkit.dsl import Flow, FlowError
from flowkit.planner.lower import lower_flow
from flowkit.runner.flowrun import FlowRunner
from flowkit.runner.setup import with_training_options
from tests.harness import tiny_gpt
from tests.torch.helpers import assert_same_training
from tests.torch.rl_ops import even_token_reward

TINY = {**tiny_gpt(), "dtype": "float64", "seed": 3}
SETTINGS = dict(prompts=4, n=3, microbatches=2, max_new_tokens=12, lr=1e-2, gpt=TINY,
                reward=even_token_reward, kl_coef=0.05, schedule="1f1b")
LAYOUTS = {"stages": dict(stages=2), "replicas": dict(stages=1), "packed": dict(stages=2)}


def _flow(layout: str, in_forward: bool) -> Flow:
    flow = grpo_flow(reference_in_forward=in_forward, **{**SETTINGS, **LAYOUTS[layout]})
    # every token's gradient counts: the KL term's reference log-probs reach the update
    flow.nodes["update_actor"].config["clip_ratio"] = 10.0
    if layout == "packed":
        for key, model in flow.models.items():
            flow.models[key] = attrs.evolve(model, packing=True)
    if layout == "replicas":
        flow = with_training_options(flow, stages=None, microbatches=None, schedule=None,
                                     replicas=2)
    return flow


def _train(pool, tmp_path, layout: str, *, in_forward: bool) -> tuple[dict, list, list]:
    tags = [("train",), ("train",), ("rollout",)]
    ran = []

    def listen(event, payload):
        if event == "task_submitted":
            task = payload["task"]
            ran.append((task.meta or {}).get("node"))
            if task.op == "profile_stage":  # the planner's costs: the last F with the reference
                ran.append(("profiled", task.config["stage"], "reference" in task.config))

    with pool.shared(3, kind="torch", tags=tags) as (ctl, _):
        ctl.add_listener(listen)
        try:
            runner = FlowRunner(ctl, lower_flow(_flow(layout, in_forward)))
            reports = [runner.run_step(step) for step in range(2)]
            paths = runner.save_weights(tmp_path / f"{layout}-{in_forward}")
        finally:
            ctl.remove_listener(listen)
    return {p.name: torch.load(p, weights_only=True) for p in paths}, reports, ran


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_reference_in_the_forward_trains_as_the_scored_one(pool, tmp_path, layout):
    scored, scored_reports, scored_ran = _train(pool, tmp_path, layout, in_forward=False)
    fused, fused_reports, fused_ran = _train(pool, tmp_path, layout, in_forward=True)
    assert "ref_logprobs" in scored_ran and "ref_logprobs" not in fused_ran
    last = LAYOUTS[layout]["stages"] - 1
    assert {r for r in fused_ran if isinstance(r, tuple)} == {
        ("profiled", stage, stage == last) for stage in range(last + 1)}
    assert_same_training(scored, fused, scored_reports, fused_reports)


def test_a_reference_without_a_kl_term_is_refused():
    with pytest.raises(ValueError, match="kl_coef=0"):
        grpo_flow(reference_in_forward=True, **{**SETTINGS, "kl_coef": 0.0})


def test_reference_tags_with_the_reference_in_the_forward_are_refused():
    with pytest.raises(ValueError, match="would place nothing"):
        grpo_flow(reference_in_forward=True, reference_tags=("rollout",), **SETTINGS)


def test_rloo_refuses_the_reference_in_the_forward():
    with pytest.raises(ValueError, match="only grpo_flow"):
        rloo_flow(reference_in_forward=True, **SETTINGS)


def _backprop_flow(reference, *, loss="grpo", kl_coef=0.05, wired=False, stages=1,
                   trained=False) -> None:
    """A GRPO-shaped flow whose Backprop names `reference`."""
    from flowkit.dsl import Model, Stream, op
    from flowkit.ops.records import Experience, Rollout

    @op
    def experiences(*, step: int = 0) -> Stream[Experience]:
        yield from ()

    actor = Model(name="actor", build="executors.torch.models.gpt:GPT", config=TINY)
    frozen = attrs.evolve(reference_of(actor), stages=stages)
    with Flow("bad") as flow:
        flow.add_model(frozen)
        items = experiences()
        refs = {}
        if wired:
            @op
            def rollouts(*, step: int = 0) -> Stream[Rollout]:
                yield from ()
            refs = {"ref_logprobs": LogProbs(frozen)(rollouts())}
        Backprop(actor)(items, loss=loss, kl_coef=kl_coef, reference=reference, **refs)
        if trained:
            Backprop(frozen)(experiences(), loss="grpo", kl_coef=kl_coef, name="update_ref")


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(reference="critic"), "names no model of the flow"),
    (dict(reference="actor"), "is the model this backprop trains"),
    (dict(reference="reference", loss="ppo"), "only loss 'grpo' with kl_coef > 0"),
    (dict(reference="reference", kl_coef=0.0), "only loss 'grpo' with kl_coef > 0"),
    (dict(reference="reference", stages=2), "the forward runs it whole"),
    (dict(reference="reference", wired=True), "both give the reference's log-probs"),
    (dict(reference="reference", trained=True), "would never see its updates"),
])
def test_a_backprop_reference_that_cannot_work_is_refused(kwargs, message):
    with pytest.raises(FlowError, match=message):
        _backprop_flow(**kwargs)


def test_the_profile_of_the_last_stage_times_the_reference_in_its_forward(monkeypatch):
    """The planner's F of the last stage is the actor's forward and the reference's."""
    from dataflows.models import GPT_BUILD
    from executors.optable import OpContext, OpTable
    from executors.torch.train import pipeline_ops

    config = {k: v for k, v in TINY.items() if k not in ("seed", "dtype")}
    spec = {"model": "actor", "build": GPT_BUILD, "seed": 3, "dtype": "float64",
            "model_config": config}
    reference = {**spec, "model": "reference", "stages": 1}
    ran = []
    real = pipeline_ops.reference_forward
    monkeypatch.setattr(pipeline_ops, "reference_forward",
                        lambda model, ids, positions: ran.append(ids.shape) or real(
                            model, ids, positions))
    table = OpTable()
    pipeline_ops.register(table)
    ctx = OpContext(name="profiled", device="cpu", tags=())
    sample = torch.randint(0, TINY["vocab_size"], (4, 9))
    for stage in (0, 1):
        times = table.get("profile_stage")(ctx, sample, stage=stage, stages=2, repeats=2,
                                           **spec, reference=reference)
        assert set(times) == {"F", "B", "W", "BW"} and times["F"] > 0
    assert ran == [(4, 8)] * 3  # the last stage's only: a warm-up and 2 timed

