"""Prompt datasets (dataflows/datasets.py): the three formats give the same rows, epochs are
shuffled by seed and counted, the cursor survives save and restore, prompts are rendered with
the tokenizer's chat template, and each bad input is one clear error when the flow is validated
(`flowkit check` included), before any executor starts. Files are built offline in tmp dirs."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.harness import requires

requires("transformers", "hf")

from click.testing import CliRunner  # noqa: E402

from dataflows.datasets import (  # noqa: E402
    PromptDataset,
    chat_sft_sequences,
    dataset_epoch,
    dataset_fields,
    dataset_prompts,
    render_prompt,
)
from flowkit.cli import main  # noqa: E402
from flowkit.dsl import Flow, FlowError  # noqa: E402
from flowkit.ops.tokenizers import load_tokenizer  # noqa: E402
from tests.hf_folders import save_tokenizer  # noqa: E402

ROWS = [{"prompt": f"What is {i}+{i}?", "answer": str(2 * i), "id": i} for i in range(10)]


def _jsonl(path, rows=ROWS):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _parquet(path, rows=ROWS):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _saved(path, rows=ROWS):
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return {"jsonl": _jsonl(root / "d.jsonl"), "parquet": _parquet(root / "d.parquet"),
            "datasets": _saved(root / "saved")}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    save_tokenizer(folder)
    return str(folder)


def test_jsonl_parquet_and_saved_datasets_give_the_same_rows(files):
    read = {kind: PromptDataset(path, seed=3) for kind, path in files.items()}
    for data in read.values():
        assert data.prompts == [r["prompt"] for r in ROWS]
        assert data.answers == [r["answer"] for r in ROWS]
    first = read["jsonl"].rows(0, 25)
    assert all(data.rows(0, 25) == first for data in read.values())
    assert {kind: dataset_fields(path) for kind, path in files.items()} == {
        kind: ["prompt", "answer", "id"] for kind in files}


def test_each_epoch_is_a_permutation_shuffled_by_seed_and_epoch(files):
    a, b = PromptDataset(files["jsonl"], seed=0), PromptDataset(files["jsonl"], seed=1)
    assert sorted(a.order(0)) == list(range(10))
    assert a.order(0) != b.order(0), "another seed reads another order"
    assert a.order(0) != a.order(1), "every epoch is shuffled afresh"
    assert a.order(1) == PromptDataset(files["parquet"], seed=0).order(1), "seed alone decides"


def test_rows_wrap_into_the_next_epoch_and_count_it(files):
    data = PromptDataset(files["jsonl"], seed=5)
    rows = data.rows(8, 5)
    assert [r.position for r in rows] == [8, 9, 10, 11, 12]
    assert [r.epoch for r in rows] == [0, 0, 1, 1, 1]
    assert [r.row for r in rows] == data.order(0)[8:] + data.order(1)[:3]
    assert [r.prompt for r in rows] == [ROWS[r.row]["prompt"] for r in rows]
    data.take(23)
    assert data.cursor == (2, 3) and data.epoch == 2
    report = dataset_epoch.fn(path=str(files["jsonl"]), count=4, step=3)  # 16 rows read of 10
    assert report.values == {"data/epoch": 1.6, "data/rows": 10}


def test_a_dataset_cursor_survives_save_and_restore(files):
    data = PromptDataset(files["jsonl"], seed=7)
    data.take(13)
    state = json.loads(json.dumps(data.state_dict()))  # plain JSON-able data
    assert state == {"epoch": 1, "index": 3, "seed": 7, "rows": 10}
    restored = PromptDataset(files["parquet"], seed=7)
    restored.load_state_dict(state)
    assert restored.cursor == data.cursor
    assert restored.take(12) == data.take(12)
    with pytest.raises(ValueError, match="seed 7.*seed 8"):
        PromptDataset(files["jsonl"], seed=8).load_state_dict(state)


def test_a_file_without_the_prompt_field_is_one_error_naming_file_field_and_fields(tmp_path):
    rows = [{"question": "q", "answer": "a"}]
    for path in (_jsonl(tmp_path / "q.jsonl", rows), _parquet(tmp_path / "q.parquet", rows),
                 _saved(tmp_path / "q", rows)):
        with pytest.raises(ValueError) as info:
            PromptDataset(path)
        message = str(info.value)
        assert str(path) in message and "'prompt'" in message and "'question'" in message
    with pytest.raises(ValueError, match="line 2"):  # a later row without it
        PromptDataset(_jsonl(tmp_path / "later.jsonl", [ROWS[0], {"answer": "1"}]))
    with pytest.raises(ValueError, match="no such file"):
        PromptDataset(tmp_path / "absent.jsonl")
    with pytest.raises(ValueError, match="unknown format"):
        PromptDataset(_jsonl(tmp_path / "d.csv"))


def test_dataset_prompts_apply_the_chat_template_and_resume_by_step(files, tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    assert load_tokenizer(tokenizer_dir) is tok, "a process loads a folder once"
    config = {"path": str(files["jsonl"]), "tokenizer": tokenizer_dir, "count": 4, "seed": 2}
    prompts = list(dataset_prompts.fn(**config, step=3))
    rows = PromptDataset(files["jsonl"], seed=2).rows(12, 4)
    assert [p.prompt_id for p in prompts] == [12, 13, 14, 15]
    for prompt, row in zip(prompts, rows):
        messages = [{"role": "user", "content": row.prompt}]
        want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        assert prompt.tokens == list(want["input_ids"] if hasattr(want, "keys") else want)
        assert prompt.text == f"<|im_start|>user\n{row.prompt}<|im_end|>\n<|im_start|>assistant\n"
        assert prompt.answer == row.answer
    assert list(dataset_prompts.fn(**config, step=3)) == prompts, "step k gives step k's prompts"
    raw = list(dataset_prompts.fn(**config, step=3, chat_template=False, system="Be brief."))
    assert raw[0].text == f"Be brief.\n\n{rows[0].prompt}"
    assert raw[0].tokens == tok(raw[0].text)["input_ids"]
    system = render_prompt(tok, "hi", system="Be brief.")
    assert system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi")


def test_chat_sft_sequences_are_prompt_answer_eos_padded_to_seq_len(files, tokenizer_dir):
    """Only the answer and its EOS are targets: the prompt and the padding are read as ~t,
    the masked form of token t [TokenIds in flowkit/ops/records.py]."""
    tok = load_tokenizer(tokenizer_dir)
    config = {"path": str(files["jsonl"]), "tokenizer": tokenizer_dir, "sequences": 3}
    rows = PromptDataset(files["jsonl"]).rows(3, 3)
    eos = tok.eos_token_id
    for completion_only in (True, False):
        items = list(chat_sft_sequences.fn(**config, seq_len=40, step=1,
                                           completion_only_loss=completion_only))
        for item, row in zip(items, rows):
            assert item.shape == (41,) and str(item.dtype) == "torch.int64"
            prompt = tok(render_prompt(tok, row.prompt), add_special_tokens=False)["input_ids"]
            answer = tok(row.answer, add_special_tokens=False)["input_ids"]
            read = [~t for t in prompt] if completion_only else prompt
            padding = [~eos] * (41 - len(prompt) - len(answer) - 1)
            assert item.tolist() == read + answer + [eos] + padding
    with pytest.raises(ValueError, match="seq_len \\+ 1 = 9"):
        list(chat_sft_sequences.fn(**config, seq_len=8))


def test_a_later_epoch_serves_the_same_rows_tokenized_once(files, tokenizer_dir, monkeypatch):
    """[Note: tokenized rows] in dataflows/datasets.py: the chat template is rendered once per
    row, however many epochs serve it."""
    import dataflows.datasets as datasets

    rendered = []
    monkeypatch.setattr(datasets, "render_prompt",
                        lambda *args, **kw: rendered.append(args[1]) or render_prompt(*args, **kw))
    datasets._kept.clear()
    config = {"path": str(files["jsonl"]), "tokenizer": tokenizer_dir, "sequences": 5,
              "seq_len": 40}
    epochs = [[t.tolist() for t in chat_sft_sequences.fn(**config, step=step)]
              for step in range(4)]  # 10 rows: steps 0-1 are epoch 0, steps 2-3 epoch 1
    assert len(rendered) == len(ROWS)
    assert sorted(epochs[0] + epochs[1]) == sorted(epochs[2] + epochs[3])


# -- bad input, before any executor starts -------------------------------------------------------
def _problems(**config) -> str:
    with pytest.raises(FlowError) as info, Flow("source"):  # a Flow validates as it closes
        dataset_prompts(**config)
    assert len(info.value.problems) == 1, info.value
    return str(info.value)


def test_each_bad_input_is_one_clear_error_when_the_flow_is_validated(tmp_path, files,
                                                                       tokenizer_dir):
    no_prompt = _jsonl(tmp_path / "q.jsonl", [{"question": "q", "answer": "a"}])
    message = _problems(path=str(no_prompt), tokenizer=tokenizer_dir)
    assert "has no field 'prompt'" in message and "'question'" in message
    message = _problems(path=str(files["parquet"]), tokenizer=tokenizer_dir,
                        answer_field="solution")
    assert "has no field 'solution'" in message and "'answer'" in message
    plain = tmp_path / "plain"
    save_tokenizer(plain, chat_template=False)
    message = _problems(path=str(files["jsonl"]), tokenizer=str(plain))
    assert "has no chat template" in message and "chat_template=False" in message
    assert "no such directory" in _problems(path=str(files["jsonl"]),
                                            tokenizer=str(tmp_path / "absent"))
    assert "holds no tokenizer" in _problems(path=str(files["jsonl"]), tokenizer=str(tmp_path))
    assert "no such file" in _problems(path=str(tmp_path / "absent.jsonl"),
                                       tokenizer=tokenizer_dir)
    with Flow("fine"):  # the same checks pass a good source and a raw one
        dataset_prompts(path=str(files["datasets"]), tokenizer=str(plain), chat_template=False,
                        answer_field=None)


def test_flowkit_check_and_run_refuse_bad_sources_before_any_executor_starts(tmp_path, files):
    plain = tmp_path / "plain"
    save_tokenizer(plain, chat_template=False)
    no_prompt = _jsonl(tmp_path / "q.jsonl", [{"question": "q", "answer": "a"}])
    flow_file = tmp_path / "flow.py"
    flow_file.write_text(textwrap.dedent(f"""
        from dataflows.datasets import dataset_prompts
        from dataflows.grpo import grpo_flow
        from dataflows.rewards import math_reward

        def chat():
            return grpo_flow(prompt_source=dataset_prompts, reward=math_reward,
                             source_config={{"path": {str(files["jsonl"])!r},
                                             "tokenizer": {str(plain)!r}}})

        def fields():
            return grpo_flow(prompt_source=dataset_prompts, reward=math_reward,
                             source_config={{"path": {str(no_prompt)!r},
                                             "tokenizer": {str(plain)!r},
                                             "chat_template": False}})
    """))
    result = CliRunner().invoke(main, ["check", f"{flow_file}:chat"])
    assert result.exit_code == 1, result.output
    assert "has no chat template" in result.output and "1 error" in result.output
    result = CliRunner().invoke(main, ["run", f"{flow_file}:fields", "--executors", "sim"])
    assert result.exit_code == 1, result.output
    assert "has no field 'prompt'" in result.output and "'question'" in result.output
    assert "executors:" not in result.output


TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_prompt_shows_its_tools_as_the_template_renders_their_schemas(files, tmp_path):
    """dataset_prompts(tools=[...]): each tool's JSON schema (dataflows.tools.schema_of) goes
    to the chat template's `tools=`, as a model trained on tool calls expects to see them."""
    from dataflows.tools import calculator, schema_of

    folder = tmp_path / "tok"
    tok = save_tokenizer(folder)
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(str(folder))
    config = {"path": str(files["jsonl"]), "tokenizer": str(folder), "count": 2,
              "tools": ["dataflows.tools:calculator"]}
    prompts = list(dataset_prompts.fn(**config))
    schema = json.dumps(schema_of(calculator))
    assert all(p.text.startswith(f"<|im_start|>system\n# Tools\n{schema}\n") for p in prompts)
    assert "Tools" not in list(dataset_prompts.fn(**{**config, "tools": None}))[0].text
    with pytest.raises(ValueError, match="keep chat_template=True"):
        dataset_prompts.check({**dataset_prompts.config, **config, "chat_template": False})
    with pytest.raises(ValueError, match="is not a function"):
        dataset_prompts.check({**dataset_prompts.config, **config, "tools": ["json:nothing"]})


def test_a_step_longer_than_the_dataset_tokenizes_each_row_once_in_one_batch(
        files, tokenizer_dir, monkeypatch):
    """[Note: tokenized rows]: 25 rows of a 10-row file in one step (its epochs wrap) are the
    rows a step of one row each gives, and each row is rendered once."""
    import dataflows.datasets as datasets

    datasets._kept.clear()
    rendered = []
    monkeypatch.setattr(datasets, "render_prompt",
                        lambda *args, **kw: rendered.append(args[1]) or render_prompt(*args, **kw))
    config = {"path": str(files["jsonl"]), "tokenizer": tokenizer_dir, "seq_len": 40}
    whole = [t.tolist() for t in chat_sft_sequences.fn(**config, sequences=25, step=0)]
    assert len(whole) == 25 and len(rendered) == len(ROWS)
    datasets._kept.clear()
    one_by_one = [t.tolist() for step in range(25)
                  for t in chat_sft_sequences.fn(**config, sequences=1, step=step)]
    assert whole == one_by_one
