"""Evaluation during training (dataflows/rl/evaluation.py, flowkit/runner/evaluation.py): the
pass@k estimate against counting, the metrics of an evaluation set, and `eval_every` running
the flow's evaluation after every K steps on the run's executors. tests/cli/test_rl_example.py
has it on torch executors, pass@1 rising with the reward."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataflows.grpo import grpo_flow
from dataflows.rl.evaluation import eval_metrics, pass_at_k
from dataflows.rl.tasks import sort_prompts, sort_reward
from flowkit import RunConfig
from flowkit.ops.records import Scored
from tests.harness import pooled_run


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 8), data=st.data())
def test_pass_at_k_is_the_share_of_k_subsets_with_a_right_sample(n, data):
    correct = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    right = [True] * correct + [False] * (n - correct)
    subsets = list(itertools.combinations(right, k))
    counted = sum(any(subset) for subset in subsets) / len(subsets)
    assert pass_at_k(n, correct, k) == pytest.approx(counted, abs=1e-12)


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match="correct <= n"):
        pass_at_k(2, 3, 1)


def _scored(prompt_id: int, sample: int, reward: float) -> Scored:
    return Scored(prompt_id=prompt_id, sample=sample, prompt_tokens=[1], response_tokens=[2],
                  logprobs=[0.0], reward=reward)


def test_the_metrics_of_an_evaluation_set_by_hand():
    # prompt 0: 1 of 3 right; prompt 1: none; prompt 2: all three (one reward above 1 counts)
    rewards = {0: [1.0, 0.0, 0.0], 1: [0.0, 0.5, 0.0], 2: [1.0, 1.0, 2.0]}
    scored = [_scored(p, i, r) for p, rs in rewards.items() for i, r in enumerate(rs)]
    metrics = eval_metrics.fn(scored).values
    assert metrics["eval/prompts"] == 3
    assert metrics["eval/pass@1"] == pytest.approx((1 / 3 + 0 + 1) / 3)
    assert metrics["eval/pass@3"] == pytest.approx(2 / 3)
    assert metrics["eval/mean@3"] == pytest.approx((1 / 3 + 0.5 / 3 + 4 / 3) / 3)
    assert metrics["eval/mean_reward"] == pytest.approx(sum(sum(r) for r in rewards.values())
                                                        / 9)
    greedy = eval_metrics.fn([_scored(p, 0, rs[0]) for p, rs in rewards.items()]).values
    assert "eval/pass@3" not in greedy and greedy["eval/pass@1"] == pytest.approx(2 / 3)


def _flow(**settings):
    return grpo_flow(**{"prompts": 4, "n": 2, "max_new_tokens": 8,
                        "prompt_source": sort_prompts, "reward": sort_reward,
                        "eval_source": sort_prompts, "eval_prompts": 6,
                        "eval_source_config": {"seed": 1}, **settings})


def test_an_rl_flow_with_an_eval_source_carries_its_evaluation_flow():
    flow = _flow(eval_n=4, eval_temperature=0.7)
    evaluation = flow.evaluation.validate()
    assert evaluation.name == "grpo-eval" and list(evaluation.models) == ["actor"]
    generate = evaluation.nodes["generate"]
    assert (generate.config["n"], generate.config["temperature"]) == (4, 0.7)
    assert evaluation.nodes["sort_prompts"].config == {"count": 6, "seed": 1, "step": 0,
                                                      "digits": 3, "pool": None}
    assert not any("backprop" in n or "optimizer" in n for n in evaluation.nodes)
    assert grpo_flow().evaluation is None


def test_eval_every_runs_the_evaluation_after_every_k_steps(pool):
    result = pooled_run(pool, _flow(eval_n=3, eval_temperature=1.0),
                        RunConfig(steps=5, executors="sim", dashboard=False, eval_every=2,
                                  stages=3))
    evaluated = [r["step"] for r in result.records if "eval/pass@1" in r]
    assert evaluated == [1, 3]
    for record in result.records:
        if "eval/pass@1" in record:
            assert record["eval/prompts"] == 6
            assert {"eval/mean_reward", "eval/pass@3", "eval/mean@3",
                    "eval/seconds"} <= set(record)


def test_bad_evaluation_settings_are_refused_when_the_flow_is_built():
    with pytest.raises(ValueError, match="eval_prompts=0"):
        _flow(eval_prompts=0)


def test_an_asynchronous_run_evaluates_alongside_the_next_step(pool):
    """[Note: evaluation during training]: the evaluation of step s's weights lands in step
    s+1's line (eval/step = s); the last step's before its own line."""
    result = pooled_run(pool, _flow(), RunConfig(steps=6, executors="sim", dashboard=False,
                                                 eval_every=2, asynchronous=True,
                                                 max_staleness=1))
    evaluated = {r["step"]: r["eval/step"] for r in result.records if "eval/pass@1" in r}
    assert evaluated == {2: 1, 4: 3, 5: 5}


def test_a_restart_drops_the_evaluation_that_ran_on_the_lost_executors():
    from flowkit.runner.evaluation import Evaluation, _Background

    def lost() -> dict:
        raise RuntimeError("executor rollout-0 lost")

    evaluation = Evaluation(_flow(), 2)
    evaluation._pending = _Background(3, lost)
    evaluation.discard()  # what StepLoop._recover does: its error is not the new run's
    assert evaluation.wait() == {}
    evaluation._pending = _Background(5, lost)
    with pytest.raises(RuntimeError, match="rollout-0 lost"):  # otherwise the step's error
        evaluation.wait()
