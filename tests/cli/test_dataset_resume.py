"""A GRPO run reading its prompts from a dataset, stopped and resumed from a checkpoint, draws
each step's prompts as the run that never stopped did, across an epoch boundary
[Note: dataset positions in dataflows/datasets.py]: the source needs no saved cursor."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.harness import requires

requires("transformers", "hf")

from tests.cli.runs import metrics_lines, run_ok  # noqa: E402
from tests.hf_folders import save_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow  # end to end: runs that start their own executor processes

_FLOW = """
from dataflows.datasets import dataset_prompts
from dataflows.grpo import grpo_flow
from dataflows.rewards import text_reward


@text_reward
def which_prompt(prompt: str, response: str, answer: str | None) -> float:
    # tells the prompts apart: each row has its own answer
    return float(answer) + len(prompt) / 1000


flow = grpo_flow(prompts=3, n=2, max_new_tokens=4, prompt_source=dataset_prompts,
                 reward=which_prompt,
                 source_config={{"path": {path!r}, "tokenizer": {tokenizer!r}, "seed": 4}})
"""


def test_a_resumed_run_draws_the_prompts_the_straight_run_drew(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": "x" * i, "answer": str(i)}) + "\n"
                            for i in range(1, 11)))
    save_tokenizer(tmp_path / "tok")
    flow = tmp_path / "flow.py"
    flow.write_text(textwrap.dedent(_FLOW.format(path=str(data), tokenizer=str(tmp_path / "tok"))))
    straight, resumed, checkpoints = (tmp_path / "straight.jsonl", tmp_path / "resumed.jsonl",
                                      tmp_path / "ck")
    sim = ["--executors", "sim", "--no-fuse"]
    run_ok(str(flow), *sim, "--steps", "5", "--metrics", str(straight))
    run_ok(str(flow), *sim, "--steps", "2", "--metrics", str(resumed),
           "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1")
    output = run_ok(str(flow), *sim, "--steps", "5", "--metrics", str(resumed),
                    "--resume", str(checkpoints))
    assert "(step 2 of 5)" in output

    def curve(path):
        return [(m["step"], m["reward_mean"], m["data/epoch"]) for m in metrics_lines(path)]

    assert curve(resumed) == curve(straight)
    assert [epoch for _, _, epoch in curve(straight)] == [0.3, 0.6, 0.9, 1.2, 1.5]
    assert len({reward for _, reward, _ in curve(straight)}) == 5, "each step its own prompts"
