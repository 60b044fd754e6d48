"""A GRPO flow whose samples are agent programs [Note: agent programs in
executors/torch/rollout/endpoint.py], end to end on torch executor processes: each sample's program
talks to the rollout executor's endpoint with the openai client, and the trajectories it makes
train the Hugging Face actor. (That fused and stage by stage train a trajectory alike is
tests/torch/test_agent_flow.py's.)"""

from __future__ import annotations

import json

import pytest
import torch

from tests.harness import requires

requires("transformers", "hf")
requires("openai", "agents")

from dataflows.datasets import dataset_prompts  # noqa: E402
from dataflows.grpo import grpo_flow  # noqa: E402
from dataflows.rewards import environment_reward  # noqa: E402
from flowkit.dsl import Model  # noqa: E402
from flowkit.planner.lower import lower_flow  # noqa: E402
from flowkit.runner.flowrun import FlowRunner  # noqa: E402
from tests.hf_folders import save_tiny_qwen2  # noqa: E402


def two_tries(task) -> float:
    """Answer; told whether it is right, answer once more; the reward is the last answer's."""
    client = task.client()
    messages = list(task.messages)
    for turn in range(2):
        reply = client.chat.completions.create(model="actor", messages=messages)
        text = reply.choices[0].message.content or ""
        right = text.strip() == task.answer
        if right or turn == 1:
            return float(right)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "No. Once more:"}]
    return 0.0


def _flow(folder, data, **settings):
    actor = Model(name="actor", build="hf", config={"path": str(folder), "dtype": "float64"},
                  stages=2, tags=("train",))
    return grpo_flow(model=actor, prompts=2, n=2, microbatches=2, schedule="1f1b",
                     max_new_tokens=3, lr=1e-2, prompt_source=dataset_prompts,
                     source_config={"path": str(data), "tokenizer": str(folder)},
                     reward=environment_reward,
                     **{"program": f"{__name__}:two_tries", "max_turns": 2, **settings})


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("programs")
    folder = save_tiny_qwen2(tmp / "qwen2")
    data = tmp / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}", "answer": str(a + b)}) + "\n"
                            for a in range(4) for b in range(4)))
    return folder, data


def test_programs_trajectories_train_the_actor(pool, task, tmp_path):
    folder, data = task
    with pool.shared(3, kind="torch", tags=[("train",), ("train",), ("rollout",)]) \
            as (ctl, _):
        runner = FlowRunner(ctl, lower_flow(_flow(folder, data)))
        reports = [runner.run_step(step) for step in range(2)]
        (path,) = runner.save_weights(tmp_path)
    for report in reports:
        metrics = report.metrics
        assert 1 <= metrics["agent/turns_mean"] <= 2 and metrics["agent/turns_max"] <= 2
        assert metrics["agent/env_error_fraction"] == 0
        assert 0 <= metrics["reward_mean"] <= 1
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(str(folder)).state_dict()
    after = load_file(str(next(path.glob("*.safetensors"))))
    assert any(not torch.equal(before[name].double(), after[name].double())
               for name in after if name in before)


@pytest.mark.parametrize(("settings", "words"), [
    ({"program": "tests.two_tries"}, "is not a function's import name"),
    ({"environment": "dataflows.envs:GuessNumber"}, "both environment="),
])
def test_bad_program_settings_are_refused_before_anything_runs(task, settings, words):
    with pytest.raises(Exception, match=words):
        _flow(*task, **settings).validate()
