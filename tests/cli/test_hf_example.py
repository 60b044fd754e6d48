"""The Hugging Face example end to end, as the README runs it: a tokenizer and a tiny Qwen2 built
offline, a supervised warm-up on chat-formatted demonstrations (in one stage here: the same
gradients as the README's two) saved as an HF folder, then GRPO from that folder with prompts
from a jsonl file, the chat template applied and EOS from the tokenizer; the mean reward rises
clearly and the trained actor is an HF folder that transformers loads."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import requires

requires("transformers", "hf")

from tests.cli.runs import run_ok_in  # noqa: E402

pytestmark = pytest.mark.slow  # end to end: runs that start their own executor processes

EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.fixture(scope="module")
def warmed_up(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2")
    (folder / "examples").symlink_to(EXAMPLES)  # the flows name their data examples/data/...
    subprocess.run([sys.executable, str(EXAMPLES / "qwen2_build.py"), "models/qwen2-tiny"],
                   cwd=folder, check=True, capture_output=True)
    # the README's 600 steps in one stage and one microbatch of 64: the same gradients as its
    # 2 stages x 4 microbatches (a token-sum loss), on one core in 60 % of the CPU time
    run_ok_in(folder, "examples/qwen2_sft.py", "--steps", "600", "--stages", "1",
              "--microbatches", "1", "--save-weights", "checkpoints")
    assert (folder / "checkpoints" / "actor" / "tokenizer.json").is_file()
    return folder


def test_grpo_on_a_tiny_qwen2_raises_the_mean_reward_and_saves_an_hf_folder(warmed_up):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    output = run_ok_in(warmed_up, "examples/qwen2_grpo.py", "--steps", "40", "--metrics",
                       "grpo.jsonl", "--save-weights", "out")
    assert "executors: torch" in output
    lines = [json.loads(line) for line in (warmed_up / "grpo.jsonl").read_text().splitlines()]
    rewards = [line["reward_mean"] for line in lines]
    assert rewards[0] < 0.3, rewards
    assert statistics.fmean(rewards[-10:]) > 0.5, rewards
    # the answers are one or two tokens, then EOS: responses end at the tokenizer's EOS
    assert statistics.fmean(line["finished_fraction"] for line in lines[-10:]) > 0.9

    out = warmed_up / "out" / "actor"
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "2+3"}],
                                           add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    tokens = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert tokens[0, -1].item() == tokenizer.eos_token_id
