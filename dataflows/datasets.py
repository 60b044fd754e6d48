"""Prompt datasets: rows of a jsonl file, a parquet file or a `datasets` folder saved to disk
(`Dataset.save_to_disk`), read for RL prompts (`dataset_prompts`) and for a supervised warm-up
(`chat_sft_sequences`), each prompt rendered with the model's chat template.

[Note: dataset positions] A dataset is read by global position: position p is row
order(epoch)[p % len] of epoch p // len, where order(epoch) is a permutation drawn from
(seed, epoch) alone. Step k's `count` rows are positions k * count ... k * count + count - 1, so
a resumed run that calls the source for step k gets exactly the prompts step k got in the
uninterrupted run, and the runner needs no saved cursor; `PromptDataset` still keeps a cursor
(`take`, `state_dict`) for loops of its own.

Bad input (a missing file, a file without the prompt or answer field, a tokenizer folder
without a chat template) is one ValueError each; the ops' `check` reports it when the flow is
validated, before any executor starts.
"""

from __future__ import annotations

import collections
import functools
import json
import random
from pathlib import Path
from typing import Any

import attrs

from dataflows.tools import schema_of, tool_function
from flowkit.dsl import Metrics, Stream, op
from flowkit.dsl.hf import check_tokenizer_dir
from flowkit.ops.records import Prompt, TokenIds
from flowkit.ops.tokenizers import load_tokenizer

__all__ = ["DatasetRow", "PromptDataset", "chat_sft_sequences", "check_fields", "dataset_epoch",
           "dataset_fields", "dataset_prompts", "render_prompt"]

_FORMATS = ".jsonl, .parquet, or a folder written by datasets' save_to_disk"


@attrs.frozen(kw_only=True)
class DatasetRow:
    """The row at one global position [Note: dataset positions]."""

    position: int
    epoch: int
    row: int  # its index in the file
    prompt: str
    answer: str | None


class PromptDataset:
    """The prompts (and answers) of a jsonl, parquet or saved `datasets` file, shuffled per
    epoch by `seed` [Note: dataset positions]. `answer_field=None`: a dataset without answers.

    ``rows(start, count)`` reads at a global position; ``take(count)`` reads at the cursor and
    moves it; ``cursor`` is (epoch, index in the epoch); ``state_dict()`` / ``load_state_dict``
    save and restore it as plain JSON-able data."""

    def __init__(self, path: str | Path, *, prompt_field: str = "prompt",
                 answer_field: str | None = "answer", seed: int = 0) -> None:
        self.path, self.seed = str(path), int(seed)
        fields = [prompt_field] + ([answer_field] if answer_field is not None else [])
        columns = _read_columns(self.path, fields)
        self.prompts = [_text(value, self.path, prompt_field, i)
                        for i, value in enumerate(columns[prompt_field])]
        self.answers = (None if answer_field is None else
                        [None if v is None else _answer(v) for v in columns[answer_field]])
        if not self.prompts:
            raise ValueError(f"dataset {self.path!r} has no rows")
        self.position = 0

    def __len__(self) -> int:
        return len(self.prompts)

    def order(self, epoch: int) -> list[int]:
        """The row indices of `epoch` in the order it reads them."""
        return list(_permutation(self.seed, int(epoch), len(self)))

    def rows(self, start: int, count: int) -> list[DatasetRow]:
        """The `count` rows from global position `start` on, wrapping into later epochs."""
        out = []
        for position in range(int(start), int(start) + int(count)):
            epoch, index = divmod(position, len(self))
            row = _permutation(self.seed, epoch, len(self))[index]
            out.append(DatasetRow(position=position, epoch=epoch, row=row,
                                  prompt=self.prompts[row],
                                  answer=None if self.answers is None else self.answers[row]))
        return out

    def take(self, count: int) -> list[DatasetRow]:
        """The next `count` rows at the cursor, which moves past them."""
        rows = self.rows(self.position, count)
        self.position += int(count)
        return rows

    @property
    def cursor(self) -> tuple[int, int]:
        """(epoch, index within the epoch) of the next row `take` reads."""
        return divmod(self.position, len(self))

    @property
    def epoch(self) -> int:
        return self.cursor[0]

    def state_dict(self) -> dict[str, int]:
        epoch, index = self.cursor
        return {"epoch": epoch, "index": index, "seed": self.seed, "rows": len(self)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from a saved cursor; refused when the saved one read another dataset (other
        rows or seed), which would silently read other prompts."""
        if int(state["rows"]) != len(self) or int(state["seed"]) != self.seed:
            raise ValueError(f"dataset {self.path!r}: the saved cursor is of a dataset of "
                             f"{state['rows']} rows with seed {state['seed']}, this one has "
                             f"{len(self)} rows and seed {self.seed}; restore it into the same "
                             "file and seed")
        index = int(state["index"])
        if not 0 <= index < len(self):
            raise ValueError(f"dataset {self.path!r}: saved index {index} is outside its "
                             f"{len(self)} rows")
        self.position = int(state["epoch"]) * len(self) + index


@functools.lru_cache(maxsize=64)
def _permutation(seed: int, epoch: int, size: int) -> tuple[int, ...]:
    order = list(range(size))
    random.Random(f"dataset/{seed}/{epoch}").shuffle(order)
    return tuple(order)


def _text(value: Any, path: str, field: str, row: int) -> str:
    if not isinstance(value, str):
        raise ValueError(f"dataset {path!r}: row {row}'s {field!r} is a "
                         f"{type(value).__name__}, not text: the prompt field holds each "
                         "prompt as a string")
    return value


def _answer(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)  # 42 -> "42"


# -- reading files ------------------------------------------------------------------------------
def _read_columns(path: str, fields: list[str]) -> dict[str, list]:
    """The columns `fields` of the dataset at `path`, after the header check."""
    check_fields(path, fields)
    kind = _kind(path)
    if kind == "jsonl":
        rows = _jsonl_rows(path)
        for i, (line, row) in enumerate(rows):
            missing = [f for f in fields if f not in row]
            if missing:
                raise ValueError(f"dataset {path!r}: row {i} (line {line}) has no field "
                                 f"{missing[0]!r}; it has {', '.join(map(repr, row)) or 'none'}")
        return {f: [row[f] for _, row in rows] for f in fields}
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path, columns=fields).to_pydict()
    from datasets import load_from_disk

    data = load_from_disk(path)
    return {f: list(data[f]) for f in fields}


def _jsonl_rows(path: str) -> list[tuple[int, dict]]:
    """(line number, row) of every non-blank line."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"dataset {path!r}: line {number} is not JSON ({exc})") from None
        if not isinstance(row, dict):
            raise ValueError(f"dataset {path!r}: line {number} is a {type(row).__name__}, not "
                             "an object of fields")
        rows.append((number, row))
    return rows


def _kind(path: Any) -> str:
    if not isinstance(path, (str, Path)) or not str(path):
        raise ValueError(f"dataset path {path!r}: give the path of a file or folder ({_FORMATS})")
    p = Path(path)
    if not p.exists():
        raise ValueError(f"dataset {path!r}: no such file or folder (a dataset is {_FORMATS})")
    if p.is_dir():
        if (p / "dataset_dict.json").is_file():
            splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
            raise ValueError(f"dataset {path!r} is a DatasetDict (splits: {', '.join(splits)}): "
                             "give the folder of one split, e.g. "
                             f"{str(p / (splits or ['train'])[0])!r}")
        if not (p / "dataset_info.json").is_file():
            raise ValueError(f"dataset {path!r} is a folder without dataset_info.json: a "
                             f"dataset is {_FORMATS}")
        return "datasets"
    if p.suffix in (".jsonl", ".parquet"):
        return p.suffix[1:]
    raise ValueError(f"dataset {path!r}: unknown format {p.suffix or '(no suffix)'!r}; a dataset "
                     f"is {_FORMATS}")


def dataset_fields(path: str | Path) -> list[str]:
    """The fields of the dataset at `path`, read from its header alone (a jsonl file's first
    row, a parquet schema, a saved dataset's dataset_info.json): cheap enough for validation."""
    path = str(path)
    kind = _kind(path)
    if kind == "jsonl":
        with open(path) as file:
            first = next((line for line in file if line.strip()), None)
        if first is None:
            raise ValueError(f"dataset {path!r} is empty")
        try:
            row = json.loads(first)
        except ValueError as exc:
            raise ValueError(f"dataset {path!r}: its first line is not JSON ({exc})") from None
        return list(row) if isinstance(row, dict) else []
    if kind == "parquet":
        import pyarrow.parquet as pq  # only for a parquet file (the hf extra brings pyarrow)

        return list(pq.read_schema(path).names)
    info = json.loads((Path(path) / "dataset_info.json").read_text())
    return list(info.get("features") or {})


def check_fields(path: str | Path, fields: list[str]) -> None:
    """A ValueError naming the file, the first of `fields` it lacks and the fields it has."""
    has = dataset_fields(path)
    missing = [f for f in fields if f not in has]
    if missing:
        raise ValueError(f"dataset {str(path)!r} has no field {missing[0]!r}; its fields are "
                         f"{', '.join(map(repr, has)) or 'none'} (pass prompt_field=... / "
                         "answer_field=... to name the ones to read)")


# -- the ops ------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def _dataset(path: str, prompt_field: str, answer_field: str | None, seed: int) -> PromptDataset:
    """A process reads a dataset once, whichever steps it serves."""
    return PromptDataset(path, prompt_field=prompt_field, answer_field=answer_field, seed=seed)


def render_prompt(tokenizer: Any, prompt: str, *, chat_template: bool = True,
                  system: str | None = None, tools: list[str] | None = None) -> str:
    """The prompt as the model sees it: a user message (after a system one when given) in the
    tokenizer's chat template, ending where the assistant's answer starts, the `tools`
    ("module:function" names) given to the template as their JSON schemas (its `tools=`, how
    a model learns what it may call: dataflows/tools.py); or `prompt` itself when
    `chat_template` is False."""
    if not chat_template:
        return prompt if system is None else f"{system}\n\n{prompt}"
    messages = _messages(prompt, system)
    schemas = [schema_of(tool_function(name)) for name in tools] if tools else None
    return tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False,
                                         add_generation_prompt=True)


def _messages(prompt: str, system: str | None) -> list[dict[str, str]]:
    """A prompt's chat: a user message, after a system one when given."""
    return ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": prompt}]


def _tokens(tokenizer: Any, text: str, *, chat_template: bool) -> list[int]:
    # a chat template writes its own special tokens (BOS and the like); a raw prompt gets the
    # tokenizer's, as tokenizer(text) gives them
    return list(tokenizer(text, add_special_tokens=not chat_template)["input_ids"])


def _check_source(config: dict[str, Any]) -> None:
    """What `dataset_prompts` and `chat_sft_sequences` check when the flow is validated."""
    fields = [config["prompt_field"]]
    if config["answer_field"] is not None:
        fields.append(config["answer_field"])
    check_fields(config["path"], fields)
    check_tokenizer_dir(config["tokenizer"], chat_template=bool(config["chat_template"]))
    tools = config.get("tools")
    if tools and not config["chat_template"]:
        raise ValueError("tools are shown to the model by its chat template: keep "
                         "chat_template=True, or leave tools out")
    for name in tools or ():
        schema_of(tool_function(name))  # a name that is no typed function fails here


def _check_sft(config: dict[str, Any]) -> None:
    if config["answer_field"] is None:
        raise ValueError("chat_sft_sequences trains on answers: give answer_field (the field "
                         "that holds each prompt's answer)")
    _check_source(config)


@op(check=_check_source)
def dataset_prompts(*, path: str, tokenizer: str, count: int = 16, seed: int = 0, step: int = 0,
                    prompt_field: str = "prompt", answer_field: str | None = "answer",
                    chat_template: bool = True, system: str | None = None,
                    tools: list[str] | None = None) -> Stream[Prompt]:
    """Step `step`'s `count` prompts of the dataset at `path` (jsonl, parquet or a saved
    `datasets` folder), shuffled per epoch by `seed` [Note: dataset positions]; each rendered
    with the chat template of the tokenizer in the folder `tokenizer` (a user message after an
    optional `system` one, `tools` given to the template as their schemas; raw with
    chat_template=False) and tokenized by it. A prompt's id is its global position, unique
    across steps; its answer is the `answer_field` (None: none)."""
    data = _dataset(str(path), prompt_field, answer_field, int(seed))
    tok = load_tokenizer(tokenizer)
    for row in data.rows(int(step) * int(count), int(count)):
        text = render_prompt(tok, row.prompt, chat_template=chat_template, system=system,
                             tools=tools)
        yield Prompt(prompt_id=row.position, tokens=_tokens(tok, text, chat_template=chat_template),
                     text=text, answer=row.answer,
                     messages=_messages(row.prompt, system) if chat_template else None)


@op
def dataset_epoch(*, path: str, tokenizer: str = "", count: int = 16, seed: int = 0,
                  step: int = 0, prompt_field: str = "prompt", answer_field: str | None = "answer",
                  chat_template: bool = True, system: str | None = None,
                  tools: list[str] | None = None) -> Metrics:
    """dataset_prompts' reporter, given the same config: `data/epoch`, the epochs read by the
    end of step `step` (1.5: one and a half passes over the rows), and `data/rows`. The RL
    flows add it beside the source they are given (dataflows/rl/front.py)."""
    rows = len(_dataset(str(path), prompt_field, answer_field, int(seed)))
    return Metrics({"data/epoch": (int(step) + 1) * int(count) / rows, "data/rows": rows})


dataset_prompts.reporter = dataset_epoch  # [Operator.reporter in flowkit/dsl/operators.py]


@op(check=_check_sft)
def chat_sft_sequences(*, path: str, tokenizer: str, sequences: int = 64, seq_len: int = 64,
                       seed: int = 0, step: int = 0, prompt_field: str = "prompt",
                       answer_field: str = "answer", chat_template: bool = True,
                       completion_only_loss: bool = True) -> Stream[TokenIds]:
    """Supervised warm-up data in token_sequences' format (dataflows/text.py): step `step`'s
    `sequences` rows of the dataset, each one int64 tensor of seq_len + 1 tokens, the templated
    prompt, then the answer and the tokenizer's EOS, padded with EOS; inputs are seq[:-1],
    targets seq[1:]. The loss is on the answer and its EOS only: the padding and (unless
    completion_only_loss is False, as in TRL) the prompt are masked [TokenIds in
    flowkit/ops/records.py]. A row longer than seq_len + 1 tokens is an error naming it."""
    import torch  # only executors run this op; declaring a flow must not need torch

    data = _dataset(str(path), prompt_field, answer_field, int(seed))
    tok = load_tokenizer(tokenizer)
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer {tokenizer!r} has no EOS token: set eos_token and save it")
    folder = str(Path(tokenizer).resolve())  # once: a resolve is a few system calls
    rows = data.rows(int(step) * int(sequences), int(sequences))
    for tokens in _sft_tokens(tok, folder, rows, int(seq_len), bool(chat_template),
                              bool(completion_only_loss)):
        yield torch.tensor(tokens, dtype=torch.int64)


# [Note: tokenized rows] Each epoch serves the same rows again: a row's tokens are kept (as
# many as a dataset of 65k rows has), not rendered through the chat template and tokenized
# once more each time; the rows a step has not seen yet are tokenized together, one call of
# the tokenizer for their prompts and one for their answers (its batch path, in Rust) rather
# than two a row. The README's Qwen2 SFT step reads 64 rows; in the first epoch the source took
# 41 ms of a 105 ms step a row at a time, 14 of 78 batched (`flowkit run examples/qwen2_sft.py
# --steps 60 --stages 1 --microbatches 1 --metrics m.jsonl`: timing_s/chat_sft_sequences).
_KEPT_ROWS = 1 << 16
_kept: collections.OrderedDict[tuple, tuple[int, ...]] = collections.OrderedDict()


def _sft_tokens(tok: Any, folder: str, rows: list[DatasetRow], seq_len: int, chat_template: bool,
                completion_only: bool) -> list[tuple[int, ...]]:
    """Each row's seq_len + 1 tokens [Note: tokenized rows]."""
    keys = [(folder, row.row, row.prompt, row.answer or "", seq_len, chat_template,
             completion_only) for row in rows]
    found = {key: _kept.get(key) for key in keys}  # this call's own: an eviction cannot race
    new = {key: row for key, row in zip(keys, rows) if found[key] is None}
    if new:
        texts = [render_prompt(tok, row.prompt, chat_template=chat_template)
                 for row in new.values()]
        prompts = tok(texts, add_special_tokens=not chat_template)["input_ids"]
        answers = tok([row.answer or "" for row in new.values()],
                      add_special_tokens=False)["input_ids"]
        for (key, row), prompt, answer in zip(new.items(), prompts, answers, strict=True):
            found[key] = _kept[key] = _sft_layout(row.row, list(prompt), list(answer),
                                                  int(tok.eos_token_id), seq_len,
                                                  completion_only)
        while len(_kept) > _KEPT_ROWS:
            _kept.popitem(last=False)
    return [found[key] for key in keys]


def _sft_layout(row: int, prompt: list[int], answer: list[int], eos: int, seq_len: int,
                completion_only: bool) -> tuple[int, ...]:
    length = len(prompt) + len(answer) + 1
    if length > seq_len + 1:
        raise ValueError(f"dataset row {row} is {length} tokens with its chat template, "
                         f"answer and EOS, more than seq_len + 1 = {seq_len + 1}: raise seq_len "
                         "or shorten the row")
    read = [~t for t in prompt] if completion_only else prompt  # ~t: read, never a target
    return (*read, *answer, eos, *[~eos] * (seq_len + 1 - length))

