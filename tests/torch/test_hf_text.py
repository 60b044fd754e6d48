"""Text on Hugging Face models: generation stops at the model's tokenizer's EOS and its rollouts
carry their decoded text [Note: rollout text in executors/torch/rollout/engine.py]; a GRPO step
reads its prompts from a dataset through the chat template and scores them with a reward on text,
and a supervised warm-up trains on chat_sft_sequences, on real executor processes. The model and its
tokenizer are a tiny Qwen2 and a BPE tokenizer built offline (tests/hf_folders.py)."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from tests.harness import requires

requires("transformers", "hf")
import torch  # noqa: E402

from dataflows.datasets import chat_sft_sequences, dataset_prompts  # noqa: E402
from dataflows.grpo import grpo_flow  # noqa: E402
from dataflows.pretrain import pretrain_flow  # noqa: E402
from dataflows.rewards import text_reward  # noqa: E402
from executors.torch.rollout import generate as gen  # noqa: E402
from executors.torch.rollout.engine import run_until_done  # noqa: E402
from flowkit.dsl import Model  # noqa: E402
from flowkit.ops.records import Prompt  # noqa: E402
from flowkit.ops.tokenizers import eos_token_ids, load_tokenizer  # noqa: E402
from flowkit.planner.lower import lower_flow  # noqa: E402
from flowkit.runner.flowrun import FlowRunner  # noqa: E402
from tests.harness import op_context  # noqa: E402
from tests.hf_folders import save_tiny_qwen2  # noqa: E402

QUESTIONS = [{"prompt": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(12)]


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return save_tiny_qwen2(tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "questions.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in QUESTIONS))
    return str(path)


def _spec(folder) -> dict:
    return {"model": "policy", "build": "executors.torch.models.hf:HFCausalLM",
            "model_config": {"path": str(folder)}, "temperature": 0.0, "max_new_tokens": 12}


def _generate(folder, prompts, **config):
    """Greedy rollouts of `prompts` by the model in `folder`, by prompt_id."""
    ctx = op_context()
    result = gen._generate(ctx, prompts, **_spec(folder), **config)
    return {r.prompt_id: r for r in run_until_done(ctx.background, result, None)}


def _prompts(folder, questions, count=2):
    return list(dataset_prompts.fn(path=questions, tokenizer=str(folder), count=count))


def _with_eos(base, folder, stop: int, *, in_tokenizer: bool):
    """A copy of the model folder `base` that ends responses at token `stop`: as its
    tokenizer's EOS, or (in_tokenizer=False) as a second EOS its generation_config names."""
    from transformers import AutoTokenizer

    shutil.copytree(base, folder)
    generation = folder / "generation_config.json"
    config = json.loads(generation.read_text())
    if in_tokenizer:
        tok = AutoTokenizer.from_pretrained(base)  # load_tokenizer's is shared
        tok.eos_token = tok.convert_ids_to_tokens(stop)
        tok.save_pretrained(str(folder))
        config.pop("eos_token_id", None)
    else:
        config["eos_token_id"] = [config["eos_token_id"], stop]
    generation.write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("where", ["tokenizer", "generation_config"])
def test_generation_stops_at_the_tokenizers_eos_and_carries_the_text(qwen2, questions, tmp_path,
                                                                     where):
    prompts = _prompts(qwen2, questions)
    free = _generate(qwen2, prompts, eos=None)  # what greedy decoding says without any stop
    first = free[prompts[0].prompt_id].response_tokens
    stop = next(t for k, t in enumerate(first) if k >= 2 and t not in first[:k])
    folder = _with_eos(qwen2, tmp_path / "stops", stop, in_tokenizer=where == "tokenizer")
    assert stop in eos_token_ids(folder)
    rollouts = _generate(folder, prompts)  # no eos given: the tokenizer's
    tok = load_tokenizer(folder)
    for prompt in prompts:
        whole = free[prompt.prompt_id].response_tokens
        r = rollouts[prompt.prompt_id]
        cut = whole.index(stop) + 1 if stop in whole else len(whole)
        assert r.response_tokens == whole[:cut] and r.finished == (stop in whole)
        assert r.response_text == tok.decode(r.response_tokens, skip_special_tokens=True)
        assert r.prompt_text == prompt.text and r.prompt_text.endswith("assistant\n")
    assert rollouts[prompts[0].prompt_id].finished


def test_a_model_without_a_tokenizer_keeps_byte_eos_and_no_text():
    prompt = Prompt(prompt_id=0, tokens=list(b"12+3="))
    ctx = op_context()
    config = {"architecture": "qwen2", "hf_config": dict(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=32, vocab_size=256, max_position_embeddings=64)}
    result = gen._generate(ctx, [prompt], model="m", build="executors.torch.models.hf:HFCausalLM",
                           model_config=config, temperature=0.0, max_new_tokens=40)
    (rollout,) = run_until_done(ctx.background, result, None)
    assert rollout.prompt_text is None and rollout.response_text is None
    tokens = rollout.response_tokens
    assert gen.EOS not in tokens[:-1] and rollout.finished == (tokens[-1] == gen.EOS)


def test_an_interrupted_rollout_continues_with_its_text(qwen2, questions):
    prompts = _prompts(qwen2, questions, count=1)
    whole = _generate(qwen2, prompts, eos=None)[prompts[0].prompt_id]
    ctx = op_context()
    spec = {**_spec(qwen2), "eos": None}
    first = gen._generate(ctx, prompts, **spec, request="r")
    engine, done = ctx.background["generate:policy"], {}
    first.bind(type("Sink", (), {"emit": lambda self, item: None, "fail": print,
                                 "done": lambda self, result: done.update(result=result)})())
    for _ in range(4):
        engine.step()
    engine.abort_requests({"r"})
    (cut,) = done["result"]
    assert cut.interrupted and cut.prompt_text == prompts[0].text
    again = gen._generate(ctx, [cut], **spec)
    (done,) = run_until_done(ctx.background, again, None)
    assert done.response_tokens == whole.response_tokens
    assert done.response_text == whole.response_text and done.prompt_text == prompts[0].text


# -- on real executors ---------------------------------------------------------------------------
@text_reward
def saw_text(prompt: str, response: str, answer: str | None) -> float:
    """1.0 when the reward op, on an executor, got the templated prompt, the decoded response
    and the dataset's answer."""
    return float(prompt.startswith("<|im_start|>user\nWhat is") and prompt.endswith(
        "<|im_start|>assistant\n") and isinstance(response, str) and answer in
        {row["answer"] for row in QUESTIONS})


def test_a_grpo_step_on_dataset_prompts_with_a_text_reward_runs_on_executors(pool, qwen2,
                                                                             questions):
    actor = Model(name="actor", build="hf", config={"path": str(qwen2)}, stages=2,
                  tags=("train",))
    flow = grpo_flow(model=actor, prompts=2, n=2, microbatches=2, max_new_tokens=6,
                     schedule="1f1b", prompt_source=dataset_prompts, reward=saw_text,
                     source_config={"path": questions, "tokenizer": str(qwen2), "seed": 1})
    tags = [("train",), ("train",), ("rollout",)]
    with pool.shared(3, kind="torch", tags=tags) as (ctl, _):
        runner = FlowRunner(ctl, lower_flow(flow))
        reports = [runner.run_step(step) for step in range(2)]
    for step, report in enumerate(reports):
        assert math.isfinite(report.metrics["update_actor/loss"])
        assert report.metrics["data/epoch"] == (step + 1) * 2 / len(QUESTIONS)
        assert report.metrics["rollout/samples"] == 4
        assert report.metrics["reward_mean"] == 1.0, "every reward read its rollout's text"


def test_a_supervised_warm_up_trains_an_hf_model_on_chat_sft_sequences(pool, qwen2, questions):
    from transformers import AutoModelForCausalLM

    model = Model(name="policy", build="hf", config={"path": str(qwen2)}, stages=2,
                  tags=("train",))
    flow = pretrain_flow(model=model, source=chat_sft_sequences, batch_size=4, microbatches=2,
                         source_config={"path": questions, "tokenizer": str(qwen2),
                                        "seq_len": 32})
    with pool.shared(2, kind="torch", tags=("train",)) as (ctl, _):
        runner = FlowRunner(ctl, lower_flow(flow))
        steps = [runner.run_step(step).metrics for step in range(3)]
    # step 0's loss is the untrained model's cross-entropy on the answers and EOS alone
    rows = torch.stack(list(chat_sft_sequences.fn(path=questions, tokenizer=str(qwen2),
                                                  seq_len=32, sequences=4)))
    targets = rows[:, 1:].clamp(min=-1)
    hf = AutoModelForCausalLM.from_pretrained(qwen2)
    with torch.no_grad():
        logits = hf(torch.where(rows < 0, ~rows, rows)[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                 ignore_index=-1)
    assert steps[0]["backprop/tokens"] == int(targets.ge(0).sum()) < 4 * 32 / 2
    assert steps[0]["backprop/loss"] == pytest.approx(float(expected), rel=1e-5)
    assert all(math.isfinite(metrics["backprop/loss"]) for metrics in steps)


def test_a_flows_eos_is_checked_when_built_and_reaches_generation(qwen2, questions):
    from dataflows.model_ops import Generate
    from flowkit.dsl import Flow, FlowError

    actor = Model(name="actor", build="hf", config={"path": str(qwen2)})
    with pytest.raises(FlowError, match="eos='end' is not a token id"), Flow("bad"):
        Generate(actor)(dataset_prompts(path=questions, tokenizer=str(qwen2)), eos="end")
    prompts = _prompts(qwen2, questions)
    free = _generate(qwen2, prompts, eos=None)
    stop = free[prompts[0].prompt_id].response_tokens[1]
    given = _generate(qwen2, prompts, eos=[stop])  # as a flow's list arrives over the wire
    assert given[prompts[0].prompt_id].response_tokens[-1] == stop
    assert given[prompts[0].prompt_id].finished
